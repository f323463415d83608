//go:build linux

package fs

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Path-name forms of MountAt, BindMountAt and UnmountAt for the tests,
// which mount and unmount at paths they made themselves. berth opens its
// targets once and acts through the handles (see the agent), so it has
// no use for these.

// Mount mounts the filesystem on source at target with mount(2). flags and
// data usually come from ParseMountOptions. target is opened with
// OpenParent and OpenAt: a symbolic link on the way is refused.
func Mount(source, target, fsType string, flags uintptr, data string) error {
	h, err := openTarget("mount target", target)
	if err != nil {
		return err
	}
	defer h.dir.Close()
	defer h.Close()
	return MountAt(source, h, fsType, flags, data)
}

// openTarget opens path in its parent directory, both without following
// symbolic links.
func openTarget(what, path string) (*Handle, error) {
	if err := checkPath(what, path); err != nil {
		return nil, err
	}
	dir, name, err := OpenParent(path)
	if err != nil {
		return nil, err
	}
	h, err := dir.OpenAt(name)
	if err != nil {
		dir.Close()
		return nil, err
	}
	return h, nil
}

// BindMount bind-mounts source on target (BindMountAt on both, opened
// without following symbolic links). Per-mount flags (ro, nosuid, nodev,
// noexec, atime flags; readOnly adds MS_RDONLY) are applied by a second
// MS_REMOUNT|MS_BIND call, since the kernel ignores them on the first; the
// remount keeps the flags the bind inherited from source. If that step
// fails, the bind is undone so no writable mount is left behind. A
// read-only bind is verified with statfs. Source may be a device node (raw
// block volumes); note that a read-only mount does not stop writes
// through a device node, the device itself must be set read-only for
// that.
func BindMount(source, target string, readOnly bool, flags uintptr) error {
	if err := checkPath("bind source", source); err != nil {
		return err
	}
	src, err := OpenPath(source)
	if err != nil {
		return err
	}
	defer src.Close()
	h, err := openTarget("bind target", target)
	if err != nil {
		return err
	}
	defer h.dir.Close()
	defer h.Close()
	return BindMountAt(src, h, readOnly, flags)
}

// Unmount unmounts target (UnmountAt in its parent directory, opened
// without following symbolic links) until nothing is mounted there
// (mounts stacked by earlier retries go too). A target that is not
// mounted or does not exist is not an error.
func Unmount(target string) error {
	if err := checkPath("unmount target", target); err != nil {
		return err
	}
	dir, name, err := OpenParent(target)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	defer dir.Close()
	return UnmountAt(dir, name, nil)
}

// MountInfo returns the entry of /proc/self/mountinfo for the mount at
// path (the top one, if several are stacked there). It is an error
// wrapping errdefs.ErrNotFound when nothing is mounted at path.
func MountInfo(path string) (*mountinfo.Info, error) {
	ok, err := IsMountPoint(path)
	if err != nil {
		return nil, err
	}
	path = filepath.Clean(path)
	if !ok {
		return nil, fmt.Errorf("mount info %s: nothing is mounted there: %w", path, errdefs.ErrNotFound)
	}
	var stx unix.Statx_t
	err = unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_MNT_ID, &stx)
	if err == nil && stx.Mask&unix.STATX_MNT_ID != 0 {
		id := int(stx.Mnt_id)
		mounts, err := getMounts(func(m *mountinfo.Info) (skip, stop bool) {
			if m.ID == id {
				return false, true
			}
			return true, false
		})
		if err != nil {
			return nil, fmt.Errorf("mount info %s: %w", path, err)
		}
		if len(mounts) == 1 {
			return mounts[0], nil
		}
		return nil, fmt.Errorf("mount info %s: mount id %d not in /proc/self/mountinfo (unmounted meanwhile?): %w", path, id, errdefs.ErrNotFound)
	}
	// No mount id from statx (Linux < 5.8): the last entry for the path
	// is the mount on top.
	real, err := resolveParent(path)
	if err != nil {
		return nil, fmt.Errorf("mount info %s: %w", path, err)
	}
	mounts, err := getMounts(func(m *mountinfo.Info) (skip, stop bool) {
		return m.Mountpoint != real, false
	})
	if err != nil {
		return nil, fmt.Errorf("mount info %s: %w", path, err)
	}
	if len(mounts) == 0 {
		return nil, fmt.Errorf("mount info %s: nothing is mounted there: %w", path, errdefs.ErrNotFound)
	}
	return mounts[len(mounts)-1], nil
}
