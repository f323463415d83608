package fs

import (
	"errors"
	"fmt"
	"math"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/errdefs"
)

// BlockDeviceSize returns the size of the block device in bytes
// (BLKGETSIZE64).
func BlockDeviceSize(devPath string) (int64, error) {
	if _, err := statBlockDevice(devPath); err != nil {
		return 0, err
	}
	f, err := blockdev.Open(devPath, unix.O_RDONLY)
	if err != nil {
		return 0, fmt.Errorf("device size %s: %w", devPath, err)
	}
	defer f.Close()
	n, err := blockdev.Size(f)
	if err != nil {
		return 0, fmt.Errorf("device size %s: %w", devPath, err)
	}
	return n, nil
}

// FlushBuffers writes the device's dirty buffers to the medium and drops
// its buffer cache (fsync, then BLKFLSBUF). Use it before detaching a
// device that was written to without a filesystem (raw block volumes).
func FlushBuffers(devPath string) error {
	if _, err := statBlockDevice(devPath); err != nil {
		return err
	}
	f, err := blockdev.Open(devPath, unix.O_RDONLY)
	if err != nil {
		return fmt.Errorf("flush %s: %w", devPath, err)
	}
	defer f.Close()
	if err := blockdev.Flush(f); err != nil {
		return fmt.Errorf("flush %s: %w", devPath, err)
	}
	return nil
}

// FilesystemStats returns the usage of the filesystem mounted at path
// (statfs). AvailableBytes is what unprivileged users can still write;
// UsedBytes counts the blocks in use, so Used+Available can be less than
// Total (reserved blocks).
func FilesystemStats(path string) (Stats, error) {
	if err := checkPath("filesystem stats", path); err != nil {
		return Stats{}, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		err = fmt.Errorf("filesystem stats %s: statfs: %w", path, err)
		if k := errnoKind(err); k != nil {
			err = fmt.Errorf("%w: %w", err, k)
		}
		return Stats{}, err
	}
	return statsFromStatfs(&st), nil
}

func statsFromStatfs(st *unix.Statfs_t) Stats {
	unit := uint64(st.Frsize)
	if unit == 0 {
		unit = uint64(st.Bsize)
	}
	used := uint64(0)
	if st.Blocks > st.Bfree {
		used = st.Blocks - st.Bfree
	}
	usedInodes := uint64(0)
	if st.Files > st.Ffree {
		usedInodes = st.Files - st.Ffree
	}
	return Stats{
		TotalBytes:     clampMul(st.Blocks, unit),
		AvailableBytes: clampMul(st.Bavail, unit),
		UsedBytes:      clampMul(used, unit),
		TotalInodes:    clamp(st.Files),
		FreeInodes:     clamp(st.Ffree),
		UsedInodes:     clamp(usedInodes),
	}
}

func clamp(v uint64) int64 {
	if v > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(v)
}

func clampMul(a, b uint64) int64 {
	if b != 0 && a > math.MaxInt64/b {
		return math.MaxInt64
	}
	return int64(a * b)
}

// SetDeviceReadOnly sets or clears the read-only flag of a block device
// at the block layer (BLKROSET). While it is set the kernel refuses every
// write to the device, whatever mount or open file it comes through, which
// a read-only mount cannot do for a device node. The flag belongs to this
// block device only; it does not clear a read-only state the driver set
// for the whole disk (a write-protected medium, a read-only loop
// attachment). Setting it needs CAP_SYS_ADMIN.
func SetDeviceReadOnly(devPath string, ro bool) error {
	if _, err := statBlockDevice(devPath); err != nil {
		return err
	}
	f, err := blockdev.Open(devPath, unix.O_RDONLY)
	if err != nil {
		return fmt.Errorf("set read-only=%t on %s: %w", ro, devPath, err)
	}
	defer f.Close()
	if err := blockdev.SetReadOnly(f, ro); err != nil {
		err = fmt.Errorf("set read-only=%t on %s: %w", ro, devPath, err)
		if k := errnoKind(err); k != nil {
			err = fmt.Errorf("%w: %w", err, k)
		}
		return err
	}
	return nil
}

// DeviceReadOnly reports whether the kernel refuses writes to a block
// device (BLKROGET): the flag SetDeviceReadOnly sets, or a read-only state
// of the whole disk.
func DeviceReadOnly(devPath string) (bool, error) {
	if _, err := statBlockDevice(devPath); err != nil {
		return false, err
	}
	f, err := blockdev.Open(devPath, unix.O_RDONLY)
	if err != nil {
		return false, fmt.Errorf("read-only state of %s: %w", devPath, err)
	}
	defer f.Close()
	ro, err := blockdev.ReadOnly(f)
	if err != nil {
		return false, fmt.Errorf("read-only state of %s: %w", devPath, err)
	}
	return ro, nil
}

// statBlockDevice checks that path is a block device and returns its
// device number.
func statBlockDevice(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("device %s: %w: %w", path, err, errdefs.ErrNotFound)
		}
		return 0, fmt.Errorf("device %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, fmt.Errorf("device %s: not a block device: %w", path, errdefs.ErrInvalidArgument)
	}
	return st.Rdev, nil
}
