package agent

import (
	"context"
	"fmt"
	"os"

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

func (realFS) EnsureFilesystem(ctx context.Context, devPath, fsType string, p fs.MkfsParams, image func() (*os.File, int64, error), beforeMkfs func() error) (bool, error) {
	return fs.EnsureFilesystem(ctx, devPath, fsType, fs.MkfsOptions{Params: p, Image: image, BeforeMkfs: beforeMkfs})
}

func (realFS) Format(ctx context.Context, devPath, fsType string, p fs.MkfsParams) error {
	return fs.Format(ctx, devPath, fsType, fs.MkfsOptions{Params: p})
}

func (realFS) Fsck(ctx context.Context, devPath, fsType string) error {
	return fs.Fsck(ctx, devPath, fsType)
}

func (realFS) FilesystemUUID(devPath, fsType string) (string, error) {
	return fs.FilesystemUUID(devPath, fsType)
}

func (realFS) Mount(source string, target *fs.Handle, fsType string, flags uintptr, data string) error {
	return fs.MountAt(source, target, fsType, flags, data)
}

func (realFS) BindMount(source, target *fs.Handle, readOnly bool, flags uintptr) error {
	return fs.BindMountAt(source, target, readOnly, flags)
}

func (realFS) Unmount(dir *fs.Handle, name string, check func(mountEntry) error) error {
	return fs.UnmountAt(dir, name, func(st fs.PathStat) error {
		if check == nil {
			return nil
		}
		return check(mountEntryOf(st))
	})
}

func (realFS) OpenDeviceNode(path string, major, minor uint32) (*fs.Handle, error) {
	h, err := fs.OpenPath(path)
	if err != nil {
		return nil, fmt.Errorf("open device node: %w", err)
	}
	st, err := h.Stat()
	if err == nil && (st.RdevMajor != major || st.RdevMinor != minor) {
		err = fmt.Errorf("device node %s stands for device %d:%d, not %d:%d: %w", path, st.RdevMajor, st.RdevMinor, major, minor, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		h.Close()
		return nil, err
	}
	return h, nil
}

func (realFS) MountPoints(major, minor uint32) ([]string, error) {
	return fs.MountPointsOf(major, minor)
}

func (realFS) MountInfo(h *fs.Handle) (mountEntry, error) {
	st, err := h.Stat()
	if err != nil {
		return mountEntry{}, err
	}
	if !st.MountRoot {
		return mountEntry{}, fmt.Errorf("%s: nothing is mounted there: %w", h.Path(), errdefs.ErrNotFound)
	}
	return mountEntryOf(st), nil
}

func (realFS) Trim(ctx context.Context, h *fs.Handle) (uint64, error) { return fs.Trim(ctx, h) }

func mountEntryOf(st fs.PathStat) mountEntry {
	return mountEntry{
		Major: int(st.Major), Minor: int(st.Minor),
		RdevMajor: int(st.RdevMajor), RdevMinor: int(st.RdevMinor),
		Ino: st.Ino, FSType: st.FSType, FSError: st.FSError,
	}
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
