//go:build !linux

package fs

import (
	"context"
	"fmt"
	"runtime"

	"github.com/moby/sys/mountinfo"

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

// Mount is only supported on Linux.
func Mount(source, target, fsType string, flags uintptr, data string) error {
	return unsupported("mount " + target)
}

// BindMount is only supported on Linux.
func BindMount(source, target string, readOnly bool, flags uintptr) error {
	return unsupported("bind mount " + target)
}

// Unmount is only supported on Linux.
func Unmount(target string) error { return unsupported("unmount " + target) }

// IsMountPoint is only supported on Linux.
func IsMountPoint(path string) (bool, error) {
	return false, unsupported("check mount point " + path)
}

// MountInfo is only supported on Linux.
func MountInfo(path string) (*mountinfo.Info, error) {
	return nil, unsupported("mount info " + path)
}

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
