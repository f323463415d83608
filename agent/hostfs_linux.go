package agent

import (
	"context"
	"fmt"

	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// realFS is hostFS on package fs.
type realFS struct{}

var _ hostFS = realFS{}

func newHostFS() hostFS { return realFS{} }

func (realFS) SupportedFsTypes() []string { return fs.SupportedFsTypes() }

func (realFS) ParseMountOptions(opts []string) (uintptr, string, error) {
	return fs.ParseMountOptions(opts)
}

func (realFS) EnsureFilesystem(ctx context.Context, devPath, fsType string) (bool, error) {
	return fs.EnsureFilesystem(ctx, devPath, fsType, fs.MkfsOptions{})
}

func (realFS) Fsck(ctx context.Context, devPath, fsType string) error {
	return fs.Fsck(ctx, devPath, fsType)
}

func (realFS) Mount(source, target, fsType string, flags uintptr, data string) error {
	return fs.Mount(source, target, fsType, flags, data)
}

func (realFS) BindMount(source, target string, readOnly bool, flags uintptr) error {
	return fs.BindMount(source, target, readOnly, flags)
}

func (realFS) Unmount(target string) error { return fs.Unmount(target) }

func (realFS) IsMountPoint(path string) (bool, error) { return fs.IsMountPoint(path) }

func (realFS) MountInfo(path string) (mountEntry, error) {
	st, err := fs.StatPath(path)
	if err != nil {
		return mountEntry{}, err
	}
	if !st.MountRoot {
		return mountEntry{}, fmt.Errorf("%s: nothing is mounted there: %w", path, errdefs.ErrNotFound)
	}
	return mountEntry{
		Major: int(st.Major), Minor: int(st.Minor),
		RdevMajor: int(st.RdevMajor), RdevMinor: int(st.RdevMinor),
		Ino: st.Ino, FSType: st.FSType,
	}, nil
}

func (realFS) Resize(ctx context.Context, devPath, mountPath, fsType string) error {
	return fs.Resize(ctx, devPath, mountPath, fsType)
}

func (realFS) Stats(path string) (fsStats, error) {
	s, err := fs.FilesystemStats(path)
	return fsStats(s), err
}

func (realFS) BlockDeviceSize(devPath string) (int64, error) { return fs.BlockDeviceSize(devPath) }

func (realFS) FlushBuffers(devPath string) error { return fs.FlushBuffers(devPath) }

func (realFS) SetDeviceReadOnly(devPath string, ro bool) error {
	return fs.SetDeviceReadOnly(devPath, ro)
}

func (realFS) DeviceReadOnly(devPath string) (bool, error) { return fs.DeviceReadOnly(devPath) }
