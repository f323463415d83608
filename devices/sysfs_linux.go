//go:build linux

package devices

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// attrDir reads the attributes of one sysfs directory through a descriptor
// of it: each read is openat, one read and close, instead of a walk of the
// whole path, a stat and a second read as with os.ReadFile. Under emulation
// every system call counts, and a device's identity is a dozen attributes.
type attrDir struct {
	fd   int
	path string
}

func openAttrDir(path string) (*attrDir, error) {
	fd, err := ignoringEINTR(func() (int, error) {
		return unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	return &attrDir{fd: fd, path: path}, nil
}

func (a *attrDir) close() { unix.Close(a.fd) }

// sysfs hands out at most a page per attribute; a longer (binary)
// attribute is read by os.ReadFile.
const attrBufSize = 4096

// read returns the attribute attr (a name or a relative path) without its
// trailing newline.
func (a *attrDir) read(attr string) (string, error) {
	fd, err := ignoringEINTR(func() (int, error) {
		return unix.Openat(a.fd, attr, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return "", &fs.PathError{Op: "open", Path: filepath.Join(a.path, attr), Err: err}
	}
	var buf [attrBufSize]byte
	n, err := ignoringEINTR(func() (int, error) { return unix.Read(fd, buf[:]) })
	unix.Close(fd)
	if err != nil {
		return "", &fs.PathError{Op: "read", Path: filepath.Join(a.path, attr), Err: err}
	}
	if n == len(buf) {
		return readAttr(a.path, attr)
	}
	return string(bytes.TrimRight(buf[:n], "\n\x00 ")), nil
}

func (a *attrDir) exists(attr string) bool {
	var st unix.Stat_t
	return unix.Fstatat(a.fd, attr, &st, unix.AT_SYMLINK_NOFOLLOW) == nil
}

func (a *attrDir) readlink(attr string) (string, error) {
	var buf [unix.PathMax]byte
	n, err := unix.Readlinkat(a.fd, attr, buf[:])
	if err != nil {
		return "", &fs.PathError{Op: "readlink", Path: filepath.Join(a.path, attr), Err: err}
	}
	return string(buf[:n]), nil
}

func (a *attrDir) readFile(attr string) ([]byte, error) {
	return os.ReadFile(filepath.Join(a.path, attr))
}

func ignoringEINTR(fn func() (int, error)) (int, error) {
	for {
		n, err := fn()
		if err != unix.EINTR {
			return n, err
		}
	}
}
