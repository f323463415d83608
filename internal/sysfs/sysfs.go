// Package sysfs holds what berth's packages share to read the kernel's
// sysfs: objects there (controllers, namespaces, sessions, disks) may go
// at any moment, and their names go to the next object of their kind.
package sysfs

import (
	"errors"
	"io/fs"
	"syscall"
)

// Gone reports whether err says a sysfs object was removed while it was
// read or written: its files are gone (ENOENT), or the kernel tore the
// object down already and its attributes answer ENODEV.
func Gone(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENODEV)
}
