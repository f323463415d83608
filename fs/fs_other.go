//go:build !linux

package fs

import (
	"context"
	"fmt"
	"os"
	"runtime"

	"github.com/berth-csi/berth/internal/errdefs"
)

func unsupported(op string) error {
	return fmt.Errorf("%s: not supported on %s: %w", op, runtime.GOOS, errdefs.ErrUnsupported)
}

// Probe is only supported on Linux.
func Probe(ctx context.Context, devPath string) (Signature, error) {
	return Signature{}, unsupported("probe " + devPath)
}

// EnsureFilesystem is only supported on Linux.
func EnsureFilesystem(ctx context.Context, devPath, fsType string, opt MkfsOptions) (bool, error) {
	return false, unsupported("format " + devPath)
}

// Format is only supported on Linux.
func Format(ctx context.Context, devPath, fsType string, opt MkfsOptions) error {
	return unsupported("format " + devPath)
}

// Fsck is only supported on Linux.
func Fsck(ctx context.Context, devPath, fsType string) error {
	return unsupported("fsck " + devPath)
}

// Resize is only supported on Linux.
func Resize(ctx context.Context, devPath, mountPath, fsType string) error {
	return unsupported("resize " + devPath)
}

// IsMountPoint is only supported on Linux.
func IsMountPoint(path string) (bool, error) {
	return false, unsupported("check mount point " + path)
}

// MountTableReads is 0: the mount table is only read on Linux.
func MountTableReads() int64 { return 0 }

// FilesystemStats is only supported on Linux.
func FilesystemStats(path string) (Stats, error) {
	return Stats{}, unsupported("filesystem stats " + path)
}

// BlockDeviceSize is only supported on Linux.
func BlockDeviceSize(devPath string) (int64, error) {
	return 0, unsupported("device size " + devPath)
}

// FlushBuffers is only supported on Linux.
func FlushBuffers(devPath string) error { return unsupported("flush " + devPath) }

// SetDeviceReadOnly is only supported on Linux.
func SetDeviceReadOnly(devPath string, ro bool) error {
	return unsupported("set read-only on " + devPath)
}

// DeviceReadOnly is only supported on Linux.
func DeviceReadOnly(devPath string) (bool, error) {
	return false, unsupported("read-only state of " + devPath)
}

// PathStat is only filled on Linux.
type PathStat struct {
	Major, Minor         uint32
	RdevMajor, RdevMinor uint32
	Ino                  uint64
	MountRoot            bool
	MountID              uint64
	FSType               string
	Dir                  bool
	Regular              bool
	FSError              error
}

// FileID is only supported on Linux.
func FileID(fi os.FileInfo) (dev, ino uint64, ok bool) { return 0, 0, false }

// StatPath is only supported on Linux.
func StatPath(path string) (PathStat, error) {
	return PathStat{}, unsupported("stat " + path)
}

// Handle is only usable on Linux.
type Handle struct{ path string }

// OpenPath is only supported on Linux.
func OpenPath(path string) (*Handle, error) { return nil, unsupported("open " + path) }

// OpenParent is only supported on Linux.
func OpenParent(path string) (*Handle, string, error) {
	return nil, "", unsupported("open parent of " + path)
}

// Path is the path h was opened as.
func (h *Handle) Path() string { return h.path }

// Close does nothing.
func (h *Handle) Close() error { return nil }

// OpenFile is only supported on Linux.
func (h *Handle) OpenFile(int) (*os.File, error) { return nil, unsupported("open " + h.path) }

// Stat is only supported on Linux.
func (h *Handle) Stat() (PathStat, error) { return PathStat{}, unsupported("stat " + h.path) }

// OpenAt is only supported on Linux.
func (h *Handle) OpenAt(name string) (*Handle, error) { return nil, unsupported("open " + name) }

// Reopen is only supported on Linux.
func (h *Handle) Reopen() (*Handle, error) { return nil, unsupported("open " + h.path) }

// MkdirAt is only supported on Linux.
func (h *Handle) MkdirAt(name string, mode uint32) error { return unsupported("mkdir " + name) }

// CreateAt is only supported on Linux.
func (h *Handle) CreateAt(name string, mode uint32) error { return unsupported("create " + name) }

// RemoveAt is only supported on Linux.
func (h *Handle) RemoveAt(name string) error { return unsupported("remove " + name) }

// Size is only supported on Linux.
func (h *Handle) Size() (int64, error) { return 0, unsupported("stat " + h.path) }

// Empty is only supported on Linux.
func (h *Handle) Empty() (bool, error) { return false, unsupported("read " + h.path) }

// MountAt is only supported on Linux.
func MountAt(source string, target *Handle, fsType string, flags uintptr, data string) error {
	return unsupported("mount " + target.path)
}

// BindMountAt is only supported on Linux.
func BindMountAt(source, target *Handle, readOnly bool, flags uintptr) error {
	return unsupported("bind mount " + target.path)
}

// UnmountAt is only supported on Linux.
func UnmountAt(dir *Handle, name string, check func(PathStat) error) error {
	return unsupported("unmount " + name)
}

// FilesystemUUID is not supported on this OS.
func FilesystemUUID(devPath, fsType string) (string, error) {
	return "", unsupported("read filesystem UUID of " + devPath)
}

// MountPointsOf is only supported on Linux.
func MountPointsOf(major, minor uint32) ([]string, error) {
	return nil, unsupported("mount table")
}

// Trim is only supported on Linux.
func Trim(ctx context.Context, h *Handle) (uint64, error) { return 0, unsupported("trim " + h.path) }
