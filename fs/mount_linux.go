package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// MountError is a failed mount(2) or umount2(2).
type MountError struct {
	Op     string // "mount", "bind", "remount", "unmount"
	Source string
	Target string
	FsType string
	Flags  uintptr
	Data   string
	Err    error // the errno
}

func (e *MountError) Error() string {
	var b strings.Builder
	switch e.Op {
	case "unmount":
		fmt.Fprintf(&b, "unmount %s", e.Target)
	case "remount":
		fmt.Fprintf(&b, "remount %s (flags %#x)", e.Target, e.Flags)
	case "bind":
		fmt.Fprintf(&b, "bind mount %s on %s", e.Source, e.Target)
	default:
		fmt.Fprintf(&b, "mount %s on %s (type %s, flags %#x, options %q)", e.Source, e.Target, e.FsType, e.Flags, e.Data)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	if e.Op == "mount" && (errors.Is(e.Err, unix.EINVAL) || errors.Is(e.Err, unix.EUCLEAN)) {
		b.WriteString(" (wrong filesystem type, bad option or corrupt filesystem; the kernel log names the reason)")
	}
	return b.String()
}

// Is matches ErrRecoveryNeedsWrite: a read-only mount refused with EROFS,
// which ext4 and xfs answer when the journal needs replaying and the
// device cannot be written.
func (e *MountError) Is(target error) bool {
	return target == ErrRecoveryNeedsWrite && e.Op == "mount" && e.Flags&MS_RDONLY != 0 && errors.Is(e.Err, unix.EROFS)
}

// Unwrap returns the errno and the errdefs sentinel it maps to.
func (e *MountError) Unwrap() []error {
	if k := errnoKind(e.Err); k != nil {
		return []error{e.Err, k}
	}
	return []error{e.Err}
}

func errnoKind(err error) error {
	var errno unix.Errno
	if !errors.As(err, &errno) {
		return nil
	}
	switch errno {
	case unix.ENOENT, unix.ENOTDIR:
		return errdefs.ErrNotFound
	case unix.EBUSY:
		return errdefs.ErrBusy
	case unix.EPERM, unix.EACCES:
		return errdefs.ErrPermissionDenied
	case unix.ENODEV:
		return errdefs.ErrUnsupported
	case unix.EROFS, unix.EUCLEAN:
		return errdefs.ErrFailedPrecondition
	}
	return nil
}

func checkPath(what, p string) error {
	if p == "" || !filepath.IsAbs(p) || strings.ContainsAny(p, "\x00\n") {
		return fmt.Errorf("%s %q: must be an absolute path without NUL or newline: %w", what, p, errdefs.ErrInvalidArgument)
	}
	return nil
}

// superblockFlags are options of the filesystem, not of one mount:
// BindMountAt accepts and ignores them (the flags of ParseMountOptions can
// be passed to both MountAt and BindMountAt).
const superblockFlags = MS_SYNCHRONOUS | MS_DIRSYNC | MS_LAZYTIME

// perMountFlags are the flags a bind mount can carry on its own.
const perMountFlags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME | MS_STRICTATIME

// statfsToMS maps statfs f_flags (ST_*) to the mount flags they report.
var statfsToMS = []struct{ st, ms uintptr }{
	{unix.ST_RDONLY, MS_RDONLY},
	{unix.ST_NOSUID, MS_NOSUID},
	{unix.ST_NODEV, MS_NODEV},
	{unix.ST_NOEXEC, MS_NOEXEC},
	{unix.ST_NOATIME, MS_NOATIME},
	{unix.ST_NODIRATIME, MS_NODIRATIME},
	{unix.ST_RELATIME, MS_RELATIME},
}

// statfsFlags returns the per-mount flags statfs reports.
func statfsFlags(st unix.Statfs_t) uintptr {
	var ms uintptr
	for _, m := range statfsToMS {
		if uintptr(st.Flags)&m.st != 0 {
			ms |= m.ms
		}
	}
	return ms
}

// maxStacked caps how many mounts stacked on one path UnmountAt removes.
const maxStacked = 64

// How IsMountPoint asks the kernel; chosen once.
const (
	viaStatx = iota
	viaOpenat2
	viaMountinfo
)

var (
	mountCheckOnce sync.Once
	mountCheck     int
)

func mountCheckMethod() int {
	mountCheckOnce.Do(func() {
		var stx unix.Statx_t
		err := unix.Statx(unix.AT_FDCWD, "/", unix.AT_SYMLINK_NOFOLLOW, unix.STATX_TYPE, &stx)
		if err == nil && stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
			mountCheck = viaStatx
			return
		}
		fd, err2 := unix.Openat2(unix.AT_FDCWD, "/", &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC})
		if err2 == nil {
			unix.Close(fd)
			mountCheck = viaOpenat2
			log().Info("statx does not report STATX_ATTR_MOUNT_ROOT; mount points are detected with openat2", "statx_error", err)
			return
		}
		mountCheck = viaMountinfo
		log().Info("neither statx STATX_ATTR_MOUNT_ROOT nor openat2 is available; mount points are detected from /proc/self/mountinfo",
			"statx_error", err, "openat2_error", err2)
	})
	return mountCheck
}

// IsMountPoint reports whether something is mounted at path (a symlink at
// path is not followed and is never a mount point). A missing path is an
// error wrapping errdefs.ErrNotFound and os.ErrNotExist.
func IsMountPoint(path string) (bool, error) {
	if err := checkPath("mount point", path); err != nil {
		return false, err
	}
	path = filepath.Clean(path)
	var (
		ok  bool
		err error
	)
	switch mountCheckMethod() {
	case viaStatx:
		ok, err = isMountPointStatx(path)
	case viaOpenat2:
		ok, err = isMountPointOpenat2(path)
	default:
		ok, err = isMountPointMountinfo(path)
	}
	if err != nil {
		err = fmt.Errorf("check mount point %s: %w", path, err)
		if errors.Is(err, unix.ENOENT) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
		}
	}
	return ok, err
}

func isMountPointStatx(path string) (bool, error) {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_TYPE, &stx); err != nil {
		return false, &os.PathError{Op: "statx", Path: path, Err: err}
	}
	return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
}

func isMountPointOpenat2(path string) (bool, error) {
	if path == "/" {
		return true, nil
	}
	dir, base := filepath.Split(path)
	dirfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	defer unix.Close(dirfd)
	fd, err := unix.Openat2(dirfd, base, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_XDEV,
	})
	if err == nil {
		unix.Close(fd)
		return false, nil
	}
	if errors.Is(err, unix.EXDEV) {
		return true, nil
	}
	return false, &os.PathError{Op: "openat2", Path: path, Err: err}
}

func isMountPointMountinfo(path string) (bool, error) {
	real, err := resolveParent(path)
	if err != nil {
		return false, err
	}
	mounts, err := getMounts(mountinfo.SingleEntryFilter(real))
	if err != nil {
		return false, err
	}
	return len(mounts) > 0, nil
}

// resolveParent resolves the symlinks in path's directory (not in its
// last element), as the kernel does for a mount point, and checks that
// path exists.
func resolveParent(path string) (string, error) {
	if path == "/" {
		return path, nil
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(path))
	if err != nil {
		return "", err
	}
	real := filepath.Join(dir, filepath.Base(path))
	var st unix.Stat_t
	if err := unix.Lstat(real, &st); err != nil {
		return "", &os.PathError{Op: "lstat", Path: real, Err: err}
	}
	return real, nil
}

// mountTableReads counts the reads of /proc/self/mountinfo, which cost
// tens of milliseconds on a node with ten thousand mounts: the checks
// berth runs per RPC ask the kernel about one path instead, and tests
// prove it by this count.
var mountTableReads atomic.Int64

// MountTableReads returns how often this process has read its mount
// table through package fs (exported as berth_mount_table_reads_total).
func MountTableReads() int64 { return mountTableReads.Load() }

func getMounts(f mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	mountTableReads.Add(1)
	return mountinfo.GetMounts(f)
}

// MountPointsOf lists the mount points of the filesystem on device
// major:minor in this mount namespace, from its mount table.
func MountPointsOf(major, minor uint32) ([]string, error) {
	mounts, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
		return uint32(i.Major) != major || uint32(i.Minor) != minor, false
	})
	if err != nil {
		return nil, fmt.Errorf("read the mount table: %w", err)
	}
	points := make([]string, len(mounts))
	for i, m := range mounts {
		points[i] = m.Mountpoint
	}
	return points, nil
}
