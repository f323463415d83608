// Package sysfs holds what berth's packages share to read the kernel's
// sysfs: objects there (controllers, namespaces, sessions, disks) may go
// at any moment, and their names go to the next object of their kind.
package sysfs

import (
	"bytes"
	"errors"
	"io/fs"
	"syscall"
)

// ReadAttr reads the sysfs attribute at path: its value without the
// newline, NULs and padding the kernel prints after it.
func ReadAttr(path string) (string, error) { return readAttrAt(atCWD, path, path) }

// ReadFile reads the whole (binary) sysfs attribute at path, such as a
// SCSI VPD page.
func ReadFile(path string) ([]byte, error) { return readFileAt(atCWD, path, path) }

// Value is the value of an attribute's content b (see ReadAttr).
func Value(b []byte) string { return string(bytes.TrimRight(b, " \t\n\x00")) }

// Gone reports whether err says a sysfs object was removed while it was
// read or written: its files are gone (ENOENT), or the kernel tore the
// object down already and its attributes answer ENODEV.
func Gone(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENODEV)
}
