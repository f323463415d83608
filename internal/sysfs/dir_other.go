//go:build !linux

package sysfs

import (
	"os"
	"path/filepath"
)

const atCWD = 0

// Dir reads the attributes of one sysfs directory.
type Dir struct{ path string }

// OpenDir opens the sysfs directory at path.
func OpenDir(path string) (*Dir, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, err
	}
	return &Dir{path: path}, nil
}

// Close closes d.
func (d *Dir) Close() error { return nil }

// Read returns the attribute attr of d, as ReadAttr does.
func (d *Dir) Read(attr string) (string, error) { return ReadAttr(filepath.Join(d.path, attr)) }

// ReadFile returns the whole attribute attr of d.
func (d *Dir) ReadFile(attr string) ([]byte, error) { return ReadFile(filepath.Join(d.path, attr)) }

// Exists reports whether d has an entry attr.
func (d *Dir) Exists(attr string) bool {
	_, err := os.Lstat(filepath.Join(d.path, attr))
	return err == nil
}

// Readlink returns the target of the symbolic link attr of d.
func (d *Dir) Readlink(attr string) (string, error) { return os.Readlink(filepath.Join(d.path, attr)) }

func readAttrAt(_ int, _, path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return Value(b), nil
}

func readFileAt(_ int, _, path string) ([]byte, error) { return os.ReadFile(path) }
