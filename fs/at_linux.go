package fs

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/forklock"
)

// Handle is a path resolved once into an O_PATH descriptor, without
// following a symbolic link anywhere on the way. Everything done through
// it (creating, mounting, unmounting, stat) acts on what was resolved,
// whatever is renamed or swapped into the path afterwards: checking a path
// by name and then mounting on the name lets a symlink put in between
// redirect the mount (CVE-2021-25741).
//
// A Handle opened with OpenAt remembers its directory and name, so that
// Reopen can look at what is at the name now: a mount made on a
// directory hides it, and a descriptor of the directory stays below the
// mount.
type Handle struct {
	fd   int
	path string // what it was opened as, for messages
	dir  *Handle
	name string
}

// resolveHow is the openat2 resolution every Handle is opened with.
const resolveHow = unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

func openErr(path string, err error) error {
	err = &os.PathError{Op: "open", Path: path, Err: err}
	switch {
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%w (a symbolic link on the way; berth does not follow them in paths it is given): %w", err, errdefs.ErrInvalidArgument)
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	case errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("%w (a component is not a directory): %w", err, errdefs.ErrInvalidArgument)
	}
	return err
}

// openat2 is refused with ENOSYS by kernels before 5.6 and by seccomp
// filters that cannot inspect its arguments (systemd's RestrictSUIDSGID=
// blocks it so that programs fall back to openat). Then each component is
// opened on its own with openat(O_PATH|O_NOFOLLOW), which resolves no
// symbolic link either: a component that is one is refused with ELOOP.
var noOpenat2 atomic.Bool

// openNoFollow opens path (absolute, or one element relative to dirfd)
// with O_PATH, following no symbolic link in any component.
func openNoFollow(dirfd int, path string, resolve uint64) (int, error) {
	if !noOpenat2.Load() {
		fd, err := unix.Openat2(dirfd, path, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: resolveHow | resolve})
		if !errors.Is(err, unix.ENOSYS) {
			return fd, err
		}
		if noOpenat2.CompareAndSwap(false, true) {
			log().Info("openat2 is not available (old kernel or a seccomp filter); paths are resolved one component at a time with O_NOFOLLOW")
		}
	}
	if resolve&^unix.RESOLVE_BENEATH != 0 {
		// RESOLVE_NO_XDEV: only asked on kernels whose statx does not
		// flag mount roots, which have no openat2 either.
		return -1, unix.ENOSYS
	}
	start := dirfd
	if filepath.IsAbs(path) {
		start = unix.AT_FDCWD
		path = strings.TrimPrefix(path, "/")
		if path == "" {
			return unix.Open("/", unix.O_PATH|unix.O_CLOEXEC|unix.O_DIRECTORY, 0)
		}
		root, err := unix.Open("/", unix.O_PATH|unix.O_CLOEXEC|unix.O_DIRECTORY, 0)
		if err != nil {
			return -1, err
		}
		defer unix.Close(root)
		start = root
	}
	fd := start
	for _, comp := range strings.Split(path, "/") {
		if comp == "" || comp == "." || comp == ".." {
			if fd != start {
				unix.Close(fd)
			}
			return -1, unix.EINVAL
		}
		next, err := unix.Openat(fd, comp, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if fd != start {
			unix.Close(fd)
		}
		if err != nil {
			return -1, err
		}
		link, err := isSymlink(next)
		if err != nil || link {
			unix.Close(next)
			if err == nil {
				err = unix.ELOOP
			}
			return -1, err
		}
		fd = next
	}
	return fd, nil
}

// isSymlink reports whether fd (O_PATH|O_NOFOLLOW) is a symbolic link.
// A filesystem shut down after I/O errors answers fstat with EIO; then
// readlinkat, which looks only at the kind of the file, tells.
func isSymlink(fd int) (bool, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	if err == nil {
		return st.Mode&unix.S_IFMT == unix.S_IFLNK, nil
	}
	if !errors.Is(err, unix.EIO) {
		return false, err
	}
	var b [1]byte
	_, err = unix.Readlinkat(fd, "", b[:])
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
		// Not a symbolic link.
		return false, nil
	}
	return false, err
}

// OpenPath opens an absolute path with openat2(RESOLVE_NO_SYMLINKS |
// RESOLVE_NO_MAGICLINKS): a symbolic link in any component, the last
// included, is an error wrapping errdefs.ErrInvalidArgument; a missing
// path wraps errdefs.ErrNotFound. A path where something is mounted
// opens the root of the mount on top.
func OpenPath(path string) (*Handle, error) {
	if err := checkPath("open", path); err != nil {
		return nil, err
	}
	path = filepath.Clean(path)
	fd, err := openNoFollow(unix.AT_FDCWD, path, 0)
	if err != nil {
		return nil, openErr(path, err)
	}
	return &Handle{fd: fd, path: path}, nil
}

// OpenParent opens the directory of path with OpenPath and returns it
// with the last element of path.
func OpenParent(path string) (dir *Handle, name string, err error) {
	if err := checkPath("open", path); err != nil {
		return nil, "", err
	}
	path = filepath.Clean(path)
	if path == "/" {
		return nil, "", fmt.Errorf("open parent of /: %w", errdefs.ErrInvalidArgument)
	}
	dir, err = OpenPath(filepath.Dir(path))
	if err != nil {
		return nil, "", err
	}
	st, err := dir.Stat()
	if err == nil && !st.Dir {
		err = fmt.Errorf("%s: not a directory: %w", dir.path, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		dir.Close()
		return nil, "", err
	}
	return dir, filepath.Base(path), nil
}

// Path is the path h was opened as.
func (h *Handle) Path() string { return h.path }

// Close closes the descriptor. The directory of a Handle from OpenAt is
// not closed with it.
func (h *Handle) Close() error {
	if h == nil || h.fd < 0 {
		return nil
	}
	err := unix.Close(h.fd)
	h.fd = -1
	return err
}

// Stat describes what h refers to (see StatFd). Where statx does not
// flag mount roots (Linux < 5.8), MountRoot of a Handle from OpenAt is
// asked of openat2 instead, as IsMountPoint does.
func (h *Handle) Stat() (PathStat, error) {
	st, err := StatFd(h.fd)
	if err != nil {
		return PathStat{}, fmt.Errorf("stat %s: %w", h.path, err)
	}
	if !st.MountRoot && h.dir != nil && mountCheckMethod() != viaStatx {
		fd, err := openNoFollow(h.dir.fd, h.name, unix.RESOLVE_NO_XDEV)
		switch {
		case err == nil:
			unix.Close(fd)
		case errors.Is(err, unix.EXDEV):
			st.MountRoot = true
		default:
			return PathStat{}, openErr(h.path, err)
		}
	}
	return st, nil
}

// procPath names the descriptor for calls that take only a path
// (mount(2), umount2(2)): the kernel resolves /proc/self/fd/N to the file
// the descriptor refers to, not to a name.
func (h *Handle) procPath() string { return "/proc/self/fd/" + strconv.Itoa(h.fd) }

// OpenFile opens the regular file h refers to for I/O with flag
// (os.O_RDONLY, os.O_RDWR): through the descriptor, so that what is
// opened is what h resolved, whatever is at its name now. Anything but a
// regular file is an error wrapping errdefs.ErrInvalidArgument.
func (h *Handle) OpenFile(flag int) (*os.File, error) {
	st, err := StatFd(h.fd)
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", h.path, err)
	}
	if !st.Regular {
		return nil, fmt.Errorf("open %s: not a regular file: %w", h.path, errdefs.ErrInvalidArgument)
	}
	f, err := os.OpenFile(h.procPath(), flag|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", h.path, err)
	}
	return f, nil
}

func checkName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("name %q: not a single path element: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (h *Handle) child(name string) string { return filepath.Join(h.path, name) }

// OpenAt opens name, one element, in directory h, following no symbolic
// link (a symlink at name is an error wrapping ErrInvalidArgument).
func (h *Handle) OpenAt(name string) (*Handle, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	fd, err := openNoFollow(h.fd, name, unix.RESOLVE_BENEATH)
	if err != nil {
		return nil, openErr(h.child(name), err)
	}
	return &Handle{fd: fd, path: h.child(name), dir: h, name: name}, nil
}

// Reopen opens again the name h was opened at (OpenAt only): after a
// mount there, the root of the new mount.
func (h *Handle) Reopen() (*Handle, error) {
	if h.dir == nil {
		return nil, fmt.Errorf("reopen %s: not opened in a directory: %w", h.path, errdefs.ErrInvalidArgument)
	}
	return h.dir.OpenAt(h.name)
}

// MkdirAt creates the directory name in h. An existing name is an error
// wrapping fs.ErrExist.
func (h *Handle) MkdirAt(name string, mode uint32) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := unix.Mkdirat(h.fd, name, mode); err != nil {
		return &os.PathError{Op: "mkdir", Path: h.child(name), Err: err}
	}
	return nil
}

// CreateAt creates the empty regular file name in h (O_CREAT|O_EXCL,
// which follows no symlink). An existing name is an error wrapping
// fs.ErrExist.
func (h *Handle) CreateAt(name string, mode uint32) error {
	if err := checkName(name); err != nil {
		return err
	}
	fd, err := unix.Openat(h.fd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	if err != nil {
		return &os.PathError{Op: "create", Path: h.child(name), Err: err}
	}
	return unix.Close(fd)
}

// RemoveAt removes name in h: an empty directory or any other file. A
// symbolic link is removed, never followed. A directory that is not empty
// and a mount point are left, with an error wrapping
// errdefs.ErrFailedPrecondition; a name on a read-only filesystem with
// one wrapping ErrReadOnly.
func (h *Handle) RemoveAt(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	err := unix.Unlinkat(h.fd, name, 0)
	if errors.Is(err, unix.EISDIR) {
		err = unix.Unlinkat(h.fd, name, unix.AT_REMOVEDIR)
	}
	if err != nil {
		perr := &os.PathError{Op: "remove", Path: h.child(name), Err: err}
		switch {
		case errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EBUSY):
			return fmt.Errorf("%w: %w", perr, errdefs.ErrFailedPrecondition)
		case errors.Is(err, unix.EROFS):
			return fmt.Errorf("%w: %w", perr, ErrReadOnly)
		}
		return perr
	}
	return nil
}

// Size is the size in bytes of the file h is open at.
func (h *Handle) Size() (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(h.fd, &st); err != nil {
		return 0, &os.PathError{Op: "stat", Path: h.path, Err: err}
	}
	return st.Size, nil
}

// Empty reports whether the directory h holds no entries.
func (h *Handle) Empty() (bool, error) {
	// "." of an O_PATH descriptor opens the same directory for reading.
	fd, err := unix.Openat(h.fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, &os.PathError{Op: "open", Path: h.path, Err: err}
	}
	f := os.NewFile(uintptr(fd), h.path)
	defer f.Close()
	_, err = f.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return true, nil
	}
	return false, err
}

// MountAt mounts the filesystem on source at the directory target with
// mount(2) on /proc/self/fd/N: the kernel mounts on what the descriptor
// refers to.
func MountAt(source string, target *Handle, fsType string, flags uintptr, data string) error {
	if err := checkPath("mount source", source); err != nil {
		return err
	}
	if fsType == "" {
		return fmt.Errorf("mount %s on %s: no filesystem type: %w", source, target.path, errdefs.ErrInvalidArgument)
	}
	if flags&(MS_BIND|MS_REMOUNT) != 0 {
		return fmt.Errorf("mount %s on %s: bind and remount flags belong to BindMountAt: %w", source, target.path, errdefs.ErrInvalidArgument)
	}
	if err := unix.Mount(source, target.procPath(), fsType, flags, data); err != nil {
		return &MountError{Op: "mount", Source: source, Target: target.path, FsType: fsType, Flags: flags, Data: data, Err: err}
	}
	return nil
}

// BindMountAt bind-mounts what source refers to (the root of a mount, a
// directory or a device node) on target, both through /proc/self/fd/N.
// Per-mount flags (ro, nosuid, nodev, noexec, atime flags; readOnly adds
// MS_RDONLY) are applied by a second MS_REMOUNT|MS_BIND call, since the
// kernel ignores them on the first; the remount keeps the flags the bind
// inherited from source. target must come from OpenAt: those flags are
// set through a descriptor of the new mount, opened at target's name and
// checked to show source; if that fails, the bind is undone, so no
// writable mount is left behind. A read-only bind is verified with
// statfs. A read-only mount does not stop writes through a device node:
// the device itself must be set read-only for that.
func BindMountAt(source, target *Handle, readOnly bool, flags uintptr) (retErr error) {
	if extra := flags &^ (perMountFlags | superblockFlags); extra != 0 {
		return fmt.Errorf("bind mount %s on %s: flags %#x cannot be set on a bind mount: %w", source.path, target.path, extra, errdefs.ErrInvalidArgument)
	}
	if target.dir == nil {
		return fmt.Errorf("bind mount %s on %s: target not opened in its directory: %w", source.path, target.path, errdefs.ErrInvalidArgument)
	}
	flags &= perMountFlags
	if readOnly {
		flags |= MS_RDONLY
	}
	src, err := source.Stat()
	if err != nil {
		return err
	}
	if err := unix.Mount(source.procPath(), target.procPath(), "", MS_BIND, ""); err != nil {
		return &MountError{Op: "bind", Source: source.path, Target: target.path, Flags: MS_BIND, Err: err}
	}
	defer func() {
		if retErr != nil {
			if err := UnmountAt(target.dir, target.name, func(st PathStat) error {
				if st.Major != src.Major || st.Minor != src.Minor || st.Ino != src.Ino {
					return fmt.Errorf("%s shows device %d:%d inode %d, not the bind made: %w", target.path, st.Major, st.Minor, st.Ino, errdefs.ErrFailedPrecondition)
				}
				return nil
			}); err != nil {
				retErr = fmt.Errorf("%w; undoing the bind mount also failed: %w", retErr, err)
			}
		}
	}()
	return setBindFlags(source, target, src, readOnly, flags)
}

// setBindFlags checks that the bind just made at target shows source
// (whose stat is src) and applies the per-mount flags through a
// descriptor of the new mount. The descriptor reaches no child started
// meanwhile: a copy would keep the mount busy for an unmount that follows
// (BindMountAt's undo, or the unpublish after a publish).
func setBindFlags(source, target *Handle, src PathStat, readOnly bool, flags uintptr) error {
	defer forklock.Hold()()
	m, err := target.Reopen()
	if err != nil {
		return fmt.Errorf("bind mount %s on %s: open the new mount: %w", source.path, target.path, err)
	}
	defer m.Close()
	got, err := m.Stat()
	if err != nil {
		return err
	}
	if !got.MountRoot || got.Major != src.Major || got.Minor != src.Minor || got.Ino != src.Ino {
		return fmt.Errorf("bind mount %s on %s: the target shows device %d:%d inode %d (mount root %t), not the source's %d:%d inode %d: %w",
			source.path, target.path, got.Major, got.Minor, got.Ino, got.MountRoot, src.Major, src.Minor, src.Ino, errdefs.ErrFailedPrecondition)
	}
	if flags == 0 {
		return nil
	}
	inherited, err := mountFlagsOf(m.fd)
	if err != nil {
		return fmt.Errorf("bind mount %s on %s: statfs: %w", source.path, target.path, err)
	}
	if flags&(MS_NOATIME|MS_RELATIME|MS_STRICTATIME) != 0 {
		inherited &^= MS_NOATIME | MS_RELATIME | MS_STRICTATIME
	}
	remount := MS_REMOUNT | MS_BIND | inherited | flags
	if err := unix.Mount("", m.procPath(), "", remount, ""); err != nil {
		return &MountError{Op: "remount", Source: source.path, Target: target.path, Flags: remount, Err: err}
	}
	if readOnly {
		ro, err := mountFlagsOf(m.fd)
		if err != nil {
			return fmt.Errorf("bind mount %s on %s: statfs: %w", source.path, target.path, err)
		}
		if ro&MS_RDONLY == 0 {
			return fmt.Errorf("bind mount %s on %s: still writable after the read-only remount", source.path, target.path)
		}
	}
	return nil
}

// UnmountAt unmounts what is mounted at name in directory dir, the mount
// on top first, until nothing is mounted there. Each mount is opened
// (without following a symlink at name), passed to check, and unmounted
// at name relative to dir's descriptor, so what is unmounted is what
// check saw, wherever the path of dir leads by now. If
// check refuses the mount on top, its error is returned and nothing is
// unmounted; if it refuses one further down (after berth's own were
// unmounted), UnmountAt stops there and returns nil: that mount was there
// before and is not berth's to remove. A missing name or nothing mounted
// is not an error.
func UnmountAt(dir *Handle, name string, check func(PathStat) error) error {
	for i := range maxStacked {
		done, err := unmountTop(dir, name, func(st PathStat) error {
			if check == nil {
				return nil
			}
			err := check(st)
			if err != nil && i > 0 {
				return errStop
			}
			return err
		})
		switch {
		case errors.Is(err, errStop):
			return nil
		case err != nil:
			return err
		case done:
			return nil
		}
	}
	return fmt.Errorf("unmount %s: more than %d mounts stacked on it: %w", dir.child(name), maxStacked, errdefs.ErrFailedPrecondition)
}

var errStop = errors.New("stop")

// busyPauses are the pauses before unmountTop tries again an unmount that
// found the mount busy: 31 ms in all.
var busyPauses = []time.Duration{time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond, 8 * time.Millisecond, 16 * time.Millisecond}

// unmountTop unmounts the mount on top at dir/name; done when nothing is
// mounted there. A mount found busy is looked at and unmounted again
// after the children being started reached their exec and a pause: a
// child holds copies of the descriptors its parent had open when it
// started (another goroutine's look at this mount) until its exec closes
// them. A mount still busy after that is in use.
func unmountTop(dir *Handle, name string, check func(PathStat) error) (done bool, err error) {
	for _, pause := range busyPauses {
		done, err = unmountTopOnce(dir, name, check)
		if !errors.Is(err, unix.EBUSY) {
			return done, err
		}
		forklock.Wait()
		time.Sleep(pause)
	}
	return unmountTopOnce(dir, name, check)
}

func unmountTopOnce(dir *Handle, name string, check func(PathStat) error) (done bool, err error) {
	st, path, err := statMountAt(dir, name)
	if errors.Is(err, errdefs.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	if !st.MountRoot {
		return true, nil
	}
	if err := check(st); err != nil {
		return false, err
	}
	// umount2 has no descriptor form, and a descriptor of the mount
	// itself keeps it busy (EBUSY). The name is looked up in the
	// directory's descriptor, so a symlink or rename higher up the path
	// cannot redirect it; UMOUNT_NOFOLLOW refuses a symlink at the name;
	// and a mount point cannot be renamed or removed while mounted, so
	// the mount on top at the name is the one just checked unless
	// something with the right to mount changed it.
	err = unix.Unmount(dir.procPath()+"/"+name, unix.UMOUNT_NOFOLLOW)
	if errors.Is(err, unix.EINVAL) {
		// Unmounted meanwhile: look again.
		return false, nil
	}
	if err != nil {
		return false, &MountError{Op: "unmount", Target: path, Err: err}
	}
	return false, nil
}

// statMountAt describes what is at name in dir, without following a
// symlink there. Its descriptor reaches no child started meanwhile: a
// copy in a child that has not yet exec'd would keep the mount busy.
func statMountAt(dir *Handle, name string) (PathStat, string, error) {
	defer forklock.Hold()()
	m, err := dir.OpenAt(name)
	if errors.Is(err, errdefs.ErrNotFound) {
		return PathStat{}, "", err
	}
	if err != nil {
		return PathStat{}, "", fmt.Errorf("unmount: %w", err)
	}
	defer m.Close()
	st, err := m.Stat()
	return st, m.path, err
}

// mountFlagsOf returns the per-mount flags of the mount fd is in.
func mountFlagsOf(fd int) (uintptr, error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return 0, err
	}
	return statfsFlags(st), nil
}
