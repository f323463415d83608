// Package blockdev asks the kernel about a block device through its node:
// whether something holds it exclusively, its size, its read-only flag, and
// writes its buffers back. Every such call of berth goes through here, so
// that one rule holds for each: the in-use check of a device that makes its
// open wait stalls only the caller, never the node's other work; a size is
// never read as a negative number; a flush reaches the medium (fsync, which
// on a block device also flushes the device's volatile cache) before the
// buffer cache is dropped.
package blockdev

import (
	"errors"
	"fmt"
	"math"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/forklock"
)

// Open opens a block device (or an image file) with flags, close-on-exec,
// and names the sentinel for the common failures: errdefs.ErrNotFound for
// a node that is not there, errdefs.ErrPermissionDenied for one berth may
// not open.
func Open(path string, flags int) (*os.File, error) {
	f, err := os.OpenFile(path, flags|unix.O_CLOEXEC, 0)
	switch {
	case err == nil:
		return f, nil
	case errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	case errors.Is(err, os.ErrPermission):
		return nil, fmt.Errorf("%w: %w", err, errdefs.ErrPermissionDenied)
	}
	return nil, err
}

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

// Size returns the size in bytes of the block device f is open on
// (BLKGETSIZE64).
func Size(f *os.File) (int64, error) {
	n, err := unix.IoctlGetUint64(int(f.Fd()), unix.BLKGETSIZE64)
	if err != nil {
		return 0, fmt.Errorf("ioctl BLKGETSIZE64: %w", err)
	}
	if n > math.MaxInt64 {
		return 0, fmt.Errorf("ioctl BLKGETSIZE64: %d bytes overflows int64", n)
	}
	return int64(n), nil
}

// LogicalBlockSize returns the logical block size of the block device f
// is open on (BLKSSZGET): the smallest unit it addresses.
func LogicalBlockSize(f *os.File) (int, error) {
	n, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKSSZGET)
	if err != nil {
		return 0, fmt.Errorf("ioctl BLKSSZGET: %w", err)
	}
	return n, nil
}

// Flush writes the dirty buffers of the block device f is open on to the
// medium, with a flush of the device's volatile cache (fsync), then drops
// its buffer cache (BLKFLSBUF), so that the next read comes from the
// medium: before a device goes away, or before another reader (a probe,
// another node) must see what was written.
func Flush(f *os.File) error {
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync: %w", err)
	}
	return DropCache(f)
}

// DropCache writes back and drops the buffer cache of the block device f
// is open on (BLKFLSBUF), without a flush of the device's own cache: for a
// reader that only needs the next reads to miss the cache.
func DropCache(f *os.File) error {
	if err := unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0); err != nil {
		return fmt.Errorf("ioctl BLKFLSBUF: %w", err)
	}
	return nil
}

// ReadOnly reports whether the kernel refuses writes to the block device
// f is open on (BLKROGET): the flag SetReadOnly sets, or a read-only state
// of the whole disk.
func ReadOnly(f *os.File) (bool, error) {
	v, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET)
	if err != nil {
		return false, fmt.Errorf("ioctl BLKROGET: %w", err)
	}
	return v != 0, nil
}

// SetReadOnly sets or clears the block layer's read-only flag of the
// block device f is open on (BLKROSET; needs CAP_SYS_ADMIN).
func SetReadOnly(f *os.File, ro bool) error {
	v := 0
	if ro {
		v = 1
	}
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, v); err != nil {
		return fmt.Errorf("ioctl BLKROSET: %w", err)
	}
	return nil
}
