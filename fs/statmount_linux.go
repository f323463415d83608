package fs

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// PathStat is what the kernel says about one path, read without the mount
// table: the device of the filesystem that holds it, its inode, whether it
// is the root of a mount, and the filesystem type. Comparing Major, Minor
// and Ino with what was recorded at mount time tells whether a path still
// shows the mount berth made, in constant time however many mounts the
// node has.
type PathStat struct {
	Major, Minor uint32 // st_dev
	// RdevMajor and RdevMinor are the device a device node stands for
	// (st_rdev); zero for other files.
	RdevMajor, RdevMinor uint32
	Ino                  uint64
	MountRoot            bool
	MountID              uint64 // 0 when the kernel does not report it (Linux < 5.8)
	FSType               string // "ext4", "xfs", or the statfs magic in hex
	Dir                  bool
	Regular              bool // a regular file
	// FSError is set when the filesystem answers getattr with EIO (a
	// shut-down xfs): the fields above were then read without asking it
	// (see statNoGetattr), and the filesystem is not usable.
	FSError error
}

// statfs magic numbers of the filesystems berth names.
const (
	ext4StatfsMagic = 0xef53 // ext2, ext3 and ext4 share it
	xfsStatfsMagic  = 0x58465342
)

func fsTypeName(magic int64) string {
	switch magic {
	case ext4StatfsMagic:
		return Ext4
	case xfsStatfsMagic:
		return XFS
	}
	return fmt.Sprintf("%#x", magic)
}

// StatPath describes path without following a symbolic link at path itself
// (its parent directories are resolved as usual; callers that must not
// follow links there open the path with OpenNoSymlinks and use StatFd). A
// missing path is an error wrapping errdefs.ErrNotFound.
func StatPath(path string) (PathStat, error) {
	if err := checkPath("stat", path); err != nil {
		return PathStat{}, err
	}
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		err = &os.PathError{Op: "open", Path: path, Err: err}
		if errors.Is(err, unix.ENOENT) {
			return PathStat{}, fmt.Errorf("stat %s: %w: %w", path, err, errdefs.ErrNotFound)
		}
		return PathStat{}, fmt.Errorf("stat %s: %w", path, err)
	}
	defer unix.Close(fd)
	st, err := StatFd(fd)
	if err != nil {
		return PathStat{}, fmt.Errorf("stat %s: %w", path, err)
	}
	if !st.MountRoot && mountCheckMethod() != viaStatx {
		// The kernel does not flag mount roots in statx: ask the way
		// IsMountPoint does.
		if st.MountRoot, err = IsMountPoint(path); err != nil {
			return PathStat{}, err
		}
	}
	return st, nil
}

// StatFd is StatPath for an open file descriptor (O_PATH is enough).
// MountRoot is reliable only where statx reports STATX_ATTR_MOUNT_ROOT
// (Linux 5.8 and later). A directory on a filesystem that answers statx
// with EIO is described without getattr, with FSError set.
func StatFd(fd int) (PathStat, error) {
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT,
		unix.STATX_TYPE|unix.STATX_INO|unix.STATX_MNT_ID, &stx); err != nil {
		err = fmt.Errorf("statx: %w", err)
		if !errors.Is(err, unix.EIO) {
			return PathStat{}, err
		}
		st, err2 := statNoGetattr(fd)
		if err2 != nil {
			return PathStat{}, fmt.Errorf("%w (the filesystem failed after I/O errors?); describing its mount without getattr: %w", err, err2)
		}
		st.FSError = err
		return st, nil
	}
	st := PathStat{
		Major:     stx.Dev_major,
		Minor:     stx.Dev_minor,
		RdevMajor: stx.Rdev_major,
		RdevMinor: stx.Rdev_minor,
		Ino:       stx.Ino,
		MountRoot: stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0,
		Dir:       stx.Mode&unix.S_IFMT == unix.S_IFDIR,
		Regular:   stx.Mode&unix.S_IFMT == unix.S_IFREG,
	}
	if stx.Mask&unix.STATX_MNT_ID != 0 {
		st.MountID = stx.Mnt_id
	}
	if stx.Mode&unix.S_IFMT == unix.S_IFLNK {
		return st, nil
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return PathStat{}, fmt.Errorf("statfs: %w", err)
	}
	st.FSType = fsTypeName(int64(sfs.Type))
	return st, nil
}

// FileID returns the device and inode numbers fi reports (from os.Stat or
// os.Lstat): the identity of a file, which every hard link to it shares.
// ok is false when fi carries no stat data.
func FileID(fi os.FileInfo) (dev, ino uint64, ok bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	return st.Dev, st.Ino, true
}
