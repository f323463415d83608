package agent

import (
	"context"

	"github.com/berth-csi/berth/fs"
)

// realFS is hostFS on package fs.
type realFS struct{}

var _ hostFS = realFS{}

func newHostFS() hostFS { return realFS{} }

func (realFS) SupportedFsTypes() []string { return fs.SupportedFsTypes() }

func (realFS) ParseMountOptions(opts []string) (uintptr, string, error) {
	return fs.ParseMountOptions(opts)
}

func (realFS) EnsureFilesystem(ctx context.Context, devPath, fsType string, beforeMkfs func() error) (bool, error) {
	return fs.EnsureFilesystem(ctx, devPath, fsType, fs.MkfsOptions{BeforeMkfs: beforeMkfs})
}

func (realFS) Format(ctx context.Context, devPath, fsType string) error {
	return fs.Format(ctx, devPath, fsType, fs.MkfsOptions{})
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
	m, err := fs.MountInfo(path)
	if err != nil {
		return mountEntry{}, err
	}
	return mountEntry{Major: m.Major, Minor: m.Minor, Root: m.Root, Source: m.Source, FSType: m.FSType, Options: m.Options}, nil
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
