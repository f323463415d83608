// Package blockdev asks the kernel about a block device through its node:
// whether something holds it exclusively. Every such check of berth goes
// through here, so that one rule holds for all of them: a device that makes
// its open wait stalls only the caller, never the node's other work.
package blockdev

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/forklock"
)

// Held reports whether the block device at path is mounted, stacked on
// (a device-mapper table) or otherwise opened exclusively: the kernel
// answers an exclusive open (O_EXCL) with EBUSY then. No mount table is
// read. Any other failure of the open is returned as an *os.PathError
// wrapping the errno.
//
// The device is opened twice. The first open, shared, is the one that
// waits when the device does (a SCSI disk whose host is in error recovery
// waits for the recovery before any open): it holds no lock, so the
// programs berth starts and the mounts of other volumes go on meanwhile.
// The exclusive open reopens that same inode (/proc/self/fd/N, never the
// name again) under the fork lock, so that no child started meanwhile
// keeps a copy that would claim the device after the check.
func Held(path string) (bool, error) {
	fd, err := openShared(path)
	if err != nil {
		return false, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return false, &os.PathError{Op: "open", Path: path, Err: unix.ENOTBLK}
	}
	defer forklock.Hold()()
	xfd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDONLY|unix.O_EXCL|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	switch {
	case err == nil:
		unix.Close(xfd)
		return false, nil
	case err == unix.EBUSY:
		return true, nil
	}
	return false, &os.PathError{Op: "open O_EXCL", Path: path, Err: err}
}

// openShared is Held's first open (tests make it wait).
var openShared = func(path string) (int, error) {
	return unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
}
