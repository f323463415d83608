package agent

import "context"

// mountEntry is the part of a mountinfo line berth compares.
type mountEntry struct {
	Major, Minor int
	Root         string // path inside the source filesystem ("/" for a device mount)
	Source       string
	FSType       string
	Options      string // per-mount options ("rw,relatime")
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
	// beforeMkfs is called once the device was found blank, right
	// before mkfs starts; an error from it stops the format.
	EnsureFilesystem(ctx context.Context, devPath, fsType string, beforeMkfs func() error) (formatted bool, err error)
	// Format creates fsType on a device without looking at what it
	// holds: only for a device whose format berth started and that a
	// crash or a failed mkfs left unfinished.
	Format(ctx context.Context, devPath, fsType string) error
	Fsck(ctx context.Context, devPath, fsType string) error
	Mount(source, target, fsType string, flags uintptr, data string) error
	BindMount(source, target string, readOnly bool, flags uintptr) error
	Unmount(target string) error
	IsMountPoint(path string) (bool, error)
	// MountInfo describes the mount at path; errdefs.ErrNotFound if none.
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
