//go:build linux

package sysfs

import (
	"io/fs"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Attributes are read with openat, read and close only. os.ReadFile adds
// a stat and a second read, and registers the descriptor with the
// runtime's poller (sysfs attributes are pollable) and removes it again:
// under emulation that makes one small attribute read 2.7 times as slow,
// and a device's identity or a session is a dozen of them.

const atCWD = unix.AT_FDCWD

// pageSize is the most the kernel prints for a text attribute: one read
// of it returns the whole value.
const pageSize = 4096

// Dir reads the attributes of one sysfs directory through a descriptor of
// it, so that each read resolves one name, not the whole path again (the
// paths of /sys/class and /sys/block pass through symbolic links).
type Dir struct {
	fd   int
	path string
}

// OpenDir opens the sysfs directory at path.
func OpenDir(path string) (*Dir, error) {
	fd, err := ignoringEINTR(func() (int, error) {
		return unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	return &Dir{fd: fd, path: path}, nil
}

// Close closes d.
func (d *Dir) Close() error { return unix.Close(d.fd) }

// Read returns the attribute attr (a name or a relative path) of d, as
// ReadAttr does.
func (d *Dir) Read(attr string) (string, error) {
	return readAttrAt(d.fd, attr, filepath.Join(d.path, attr))
}

// ReadFile returns the whole (binary) attribute attr of d.
func (d *Dir) ReadFile(attr string) ([]byte, error) {
	return readFileAt(d.fd, attr, filepath.Join(d.path, attr))
}

// Exists reports whether d has an entry attr.
func (d *Dir) Exists(attr string) bool {
	var st unix.Stat_t
	return unix.Fstatat(d.fd, attr, &st, unix.AT_SYMLINK_NOFOLLOW) == nil
}

// Readlink returns the target of the symbolic link attr of d.
func (d *Dir) Readlink(attr string) (string, error) {
	var buf [unix.PathMax]byte
	n, err := unix.Readlinkat(d.fd, attr, buf[:])
	if err != nil {
		return "", &fs.PathError{Op: "readlink", Path: filepath.Join(d.path, attr), Err: err}
	}
	return string(buf[:n]), nil
}

// readAttrAt reads a text attribute: one read of a page, which holds all
// of it; a page filled to the end is read again in full.
func readAttrAt(dirfd int, name, path string) (string, error) {
	fd, err := openAt(dirfd, name, path)
	if err != nil {
		return "", err
	}
	var buf [pageSize]byte
	n, err := ignoringEINTR(func() (int, error) { return unix.Read(fd, buf[:]) })
	unix.Close(fd)
	if err != nil {
		return "", &fs.PathError{Op: "read", Path: path, Err: err}
	}
	if n < len(buf) {
		return Value(buf[:n]), nil
	}
	b, err := readFileAt(dirfd, name, path)
	if err != nil {
		return "", err
	}
	return Value(b), nil
}

// readFileAt reads a file to its end.
func readFileAt(dirfd int, name, path string) ([]byte, error) {
	fd, err := openAt(dirfd, name, path)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	b := make([]byte, 0, pageSize)
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := ignoringEINTR(func() (int, error) { return unix.Read(fd, b[len(b):cap(b)]) })
		if err != nil {
			return nil, &fs.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			return b, nil
		}
		b = b[:len(b)+n]
	}
}

func openAt(dirfd int, name, path string) (int, error) {
	fd, err := ignoringEINTR(func() (int, error) {
		return unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return -1, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	return fd, nil
}

func ignoringEINTR(fn func() (int, error)) (int, error) {
	for {
		n, err := fn()
		if err != unix.EINTR {
			return n, err
		}
	}
}
