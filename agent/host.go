package agent

import (
	"context"
	"os"

	"github.com/berth-csi/berth/fs"
)

// mountEntry describes the mount at a path, as the kernel reports it for
// the path itself (no mount table is read).
type mountEntry struct {
	Major, Minor int // the mounted filesystem's device
	// RdevMajor and RdevMinor are the device of a device node bound at
	// the path (a raw block publish).
	RdevMajor, RdevMinor int
	Ino                  uint64 // inode at the path
	FSType               string
	// FSError is set when the filesystem fails getattr (shut down after
	// I/O errors): the mount is still identified, and can be unmounted,
	// but not used (checkUsable).
	FSError error
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
	// image, when not nil, gives the image file the device shows (see
	// fs.MkfsOptions.Image). beforeMkfs is called once the device was
	// found blank, right before mkfs starts; an error from it stops the
	// format. p is the new filesystem's geometry.
	EnsureFilesystem(ctx context.Context, devPath, fsType string, p fs.MkfsParams, image func() (*os.File, int64, error), beforeMkfs func() error) (formatted bool, err error)
	// Format creates fsType on a device without looking at what it
	// holds: only for a device whose format berth started and that a
	// crash or a failed mkfs left unfinished. p is the new filesystem's
	// geometry, from the stage's volume_context, for both.
	Format(ctx context.Context, devPath, fsType string, p fs.MkfsParams) error
	Fsck(ctx context.Context, devPath, fsType string) error
	// FilesystemUUID reads the UUID of the fsType filesystem on a
	// device from its superblock.
	FilesystemUUID(devPath, fsType string) (string, error)
	// Mount, BindMount, Unmount and MountInfo act on paths already
	// opened (fs.Handle: resolved once, no symlinks), never on names,
	// so that a path swapped after it was checked cannot redirect them.
	Mount(source string, target *fs.Handle, fsType string, flags uintptr, data string) error
	// BindMount binds source on target; target comes from OpenAt.
	BindMount(source, target *fs.Handle, readOnly bool, flags uintptr) error
	// Unmount unmounts what is mounted at name in dir, each mount only
	// after check accepted it (fs.UnmountAt): a refused mount on top is
	// the error, nothing unmounted.
	Unmount(dir *fs.Handle, name string, check func(mountEntry) error) error
	// OpenDeviceNode opens a device node (no symlinks on the way) and
	// checks that it stands for major:minor: a raw block publish binds
	// what was opened.
	OpenDeviceNode(path string, major, minor uint32) (*fs.Handle, error)
	// MountInfo describes the mount whose root h is;
	// errdefs.ErrNotFound if h is not the root of a mount.
	MountInfo(h *fs.Handle) (mountEntry, error)
	// MountPoints lists where the filesystem of device major:minor is
	// mounted in this mount namespace (the mount table, filtered).
	MountPoints(major, minor uint32) ([]string, error)
	// Trim discards the unused blocks of the filesystem whose mount
	// root h is (fs.Trim) and returns the bytes trimmed.
	Trim(ctx context.Context, h *fs.Handle) (uint64, error)
	Resize(ctx context.Context, devPath, mountPath, fsType string) error
	Stats(path string) (fsStats, error)
	BlockDeviceSize(devPath string) (int64, error)
	FlushBuffers(devPath string) error
	// SetDeviceReadOnly sets or clears the block layer's read-only flag
	// of a device; DeviceReadOnly reads it back.
	SetDeviceReadOnly(devPath string, ro bool) error
	DeviceReadOnly(devPath string) (bool, error)
}
