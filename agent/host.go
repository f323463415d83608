package agent

import "context"

// mountEntry describes the mount at a path, as the kernel reports it for
// the path itself (no mount table is read).
type mountEntry struct {
	Major, Minor int // the mounted filesystem's device
	// RdevMajor and RdevMinor are the device of a device node bound at
	// the path (a raw block publish).
	RdevMajor, RdevMinor int
	Ino                  uint64 // inode at the path
	FSType               string
}

// fsStats is what NodeGetVolumeStats reports for a mounted filesystem.
type fsStats struct {
	TotalBytes, AvailableBytes, UsedBytes int64
	TotalInodes, FreeInodes, UsedInodes   int64
}

// hostFS is the filesystem layer as the node service uses it. The real
// implementation is package fs (hostfs_linux.go); tests substitute fakes
// to drive races and failures a real kernel does not produce on demand.
type hostFS interface {
	SupportedFsTypes() []string
	ParseMountOptions(opts []string) (flags uintptr, data string, err error)
	// EnsureFilesystem creates fsType on a blank device and refuses one
	// that holds anything else (errdefs.ErrFailedPrecondition).
	EnsureFilesystem(ctx context.Context, devPath, fsType string) (formatted bool, err error)
	Fsck(ctx context.Context, devPath, fsType string) error
	Mount(source, target, fsType string, flags uintptr, data string) error
	BindMount(source, target string, readOnly bool, flags uintptr) error
	Unmount(target string) error
	IsMountPoint(path string) (bool, error)
	// MountInfo describes the mount at path; errdefs.ErrNotFound if
	// path is not the root of a mount.
	MountInfo(path string) (mountEntry, error)
	Resize(ctx context.Context, devPath, mountPath, fsType string) error
	Stats(path string) (fsStats, error)
	BlockDeviceSize(devPath string) (int64, error)
	FlushBuffers(devPath string) error
	// SetDeviceReadOnly sets or clears the block layer's read-only flag
	// of a device; DeviceReadOnly reads it back.
	SetDeviceReadOnly(devPath string, ro bool) error
	DeviceReadOnly(devPath string) (bool, error)
}
