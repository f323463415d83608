//go:build !linux

package devices

import (
	"os"
	"path/filepath"
)

// attrDir reads the attributes of one sysfs directory.
type attrDir struct{ path string }

func openAttrDir(path string) (*attrDir, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, err
	}
	return &attrDir{path: path}, nil
}

func (a *attrDir) close() {}

func (a *attrDir) read(attr string) (string, error) { return readAttr(a.path, attr) }

func (a *attrDir) exists(attr string) bool {
	_, err := os.Lstat(filepath.Join(a.path, attr))
	return err == nil
}

func (a *attrDir) readlink(attr string) (string, error) {
	return os.Readlink(filepath.Join(a.path, attr))
}

func (a *attrDir) readFile(attr string) ([]byte, error) {
	return os.ReadFile(filepath.Join(a.path, attr))
}
