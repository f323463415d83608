package fs

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// A filesystem that stopped after I/O errors (a shut-down xfs) answers
// every getattr, statx included, with EIO, while it stays mounted: its
// mount must still be identified to be unmounted. statNoGetattr
// describes a descriptor from what the kernel keeps about the open file
// and its mount, which no filesystem is asked about: the mount ID and
// inode number of /proc/self/fdinfo, the superblock's device from
// statmount(2) (or, on kernels without it, /proc/self/mountinfo, matched
// by that mount ID), and the mount of ".." opened from the descriptor.

// statNoGetattr describes fd as StatFd does, without getattr. Dir is
// true only when ".." could be opened from fd; a file that is not a
// directory is an error: whether it is a mount root is not known.
// MountRoot is false for a mount with no parent (detached, or the root
// of the process).
func statNoGetattr(fd int) (PathStat, error) {
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		return PathStat{}, err
	}
	fi, err := parseFdinfo(b)
	if err != nil {
		return PathStat{}, err
	}
	major, minor, err := mountDevice(fd, fi.mntID)
	if err != nil {
		return PathStat{}, err
	}
	root, err := isMountRootNoGetattr(fd, fi.mntID)
	if err != nil {
		return PathStat{}, err
	}
	st := PathStat{Major: major, Minor: minor, Ino: fi.ino, MountRoot: root, MountID: fi.mntID, Dir: true}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return PathStat{}, fmt.Errorf("statfs: %w", err)
	}
	st.FSType = fsTypeName(int64(sfs.Type))
	return st, nil
}

// fdinfo is what /proc/self/fdinfo/N says about a descriptor's file.
type fdinfo struct {
	mntID uint64 // the mount ID of /proc/self/mountinfo (reused after unmount)
	ino   uint64
}

// parseFdinfo reads the mnt_id and ino lines of /proc/self/fdinfo/N
// (ino since Linux 5.14).
func parseFdinfo(b []byte) (fdinfo, error) {
	var fi fdinfo
	var haveMnt, haveIno bool
	for _, line := range bytes.Split(b, []byte("\n")) {
		k, v, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		var dst *uint64
		switch string(k) {
		case "mnt_id":
			dst, haveMnt = &fi.mntID, true
		case "ino":
			dst, haveIno = &fi.ino, true
		default:
			continue
		}
		n, err := strconv.ParseUint(string(bytes.TrimSpace(v)), 10, 64)
		if err != nil {
			return fdinfo{}, fmt.Errorf("fdinfo: %s: %w", k, err)
		}
		*dst = n
	}
	if !haveMnt || !haveIno {
		return fdinfo{}, fmt.Errorf("fdinfo: no mnt_id or ino line (Linux 5.14 or later reports both)")
	}
	return fi, nil
}

// isMountRootNoGetattr reports whether fd, a directory in the mount
// mntID, is the root of that mount: ".." of a mount root is in the
// mount below it, ".." of any other directory in the same mount.
func isMountRootNoGetattr(fd int, mntID uint64) (bool, error) {
	up, err := unix.Openat(fd, "..", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("open ..: %w", err)
	}
	defer unix.Close(up)
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(up))
	if err != nil {
		return false, err
	}
	fi, err := parseFdinfo(b)
	if err != nil {
		return false, err
	}
	return fi.mntID != mntID, nil
}

// noStatmount is set once the kernel turned down statmount(2) (Linux
// 6.8) or the unique mount ID it takes (name_to_handle_at's
// AT_HANDLE_MNT_ID_UNIQUE, Linux 6.12): mountDevice reads
// /proc/self/mountinfo instead.
var noStatmount atomic.Bool

// mountDevice returns the device of the filesystem fd's mount (mntID)
// shows, sb->s_dev, which statx reports as st_dev for ext4 and xfs.
func mountDevice(fd int, mntID uint64) (major, minor uint32, err error) {
	if !noStatmount.Load() {
		major, minor, err := statmountDevice(fd, mntID)
		// EINVAL: a flag or the mount ID unknown to the kernel; EPERM:
		// a seccomp filter older than the call.
		if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EPERM) {
			return major, minor, err
		}
		if noStatmount.CompareAndSwap(false, true) {
			log().Info("statmount or unique mount IDs are not available (Linux < 6.12); the mount of a filesystem that fails getattr is found in /proc/self/mountinfo", "error", err)
		}
	}
	mounts, err := getMounts(func(m *mountinfo.Info) (skip, stop bool) {
		return uint64(m.ID) != mntID, uint64(m.ID) == mntID
	})
	if err != nil {
		return 0, 0, err
	}
	if len(mounts) == 0 {
		return 0, 0, fmt.Errorf("mount ID %d: not in /proc/self/mountinfo", mntID)
	}
	return uint32(mounts[0].Major), uint32(mounts[0].Minor), nil
}

// Kernel ABI of name_to_handle_at(2) and statmount(2) not in x/sys/unix.
const (
	atHandleMntIDUnique = 0x001 // AT_HANDLE_MNT_ID_UNIQUE: a 64-bit mount ID
	atHandleFID         = 0x200 // AT_HANDLE_FID: any filesystem, export ops or not
	maxHandleSz         = 128

	statmountSBBasic  = 0x1 // STATMOUNT_SB_BASIC
	statmountMntBasic = 0x2 // STATMOUNT_MNT_BASIC
	mntIDReqSizeVer0  = 24
)

// mntIDReq is struct mnt_id_req.
type mntIDReq struct {
	size, spare uint32
	mntID       uint64
	param       uint64
}

// statmountDevice asks statmount(2) about fd's mount, named by the unique
// mount ID name_to_handle_at returns for fd, and checks that it is the
// mount mntID.
func statmountDevice(fd int, mntID uint64) (major, minor uint32, err error) {
	var fh struct {
		bytes uint32
		typ   int32
		f     [maxHandleSz]byte
	}
	fh.bytes = maxHandleSz
	var unique uint64
	empty := []byte{0}
	_, _, e := unix.Syscall6(unix.SYS_NAME_TO_HANDLE_AT, uintptr(fd), uintptr(unsafe.Pointer(&empty[0])),
		uintptr(unsafe.Pointer(&fh)), uintptr(unsafe.Pointer(&unique)), unix.AT_EMPTY_PATH|atHandleMntIDUnique|atHandleFID, 0)
	// The mount ID is written even when the handle does not fit.
	if e != 0 && e != unix.EOVERFLOW {
		return 0, 0, fmt.Errorf("name_to_handle_at: %w", e)
	}
	req := mntIDReq{size: mntIDReqSizeVer0, mntID: unique, param: statmountSBBasic | statmountMntBasic}
	buf := make([]byte, 4096)
	_, _, e = unix.Syscall6(unix.SYS_STATMOUNT, uintptr(unsafe.Pointer(&req)), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0, 0)
	if e != 0 {
		return 0, 0, fmt.Errorf("statmount: %w", e)
	}
	sm, err := parseStatmount(buf)
	if err != nil {
		return 0, 0, err
	}
	if sm.mntIDOld != mntID {
		return 0, 0, fmt.Errorf("statmount: mount %d is mount ID %d, the descriptor's is %d", unique, sm.mntIDOld, mntID)
	}
	return sm.major, sm.minor, nil
}

// statmount is what statmountDevice reads of struct statmount.
type statmount struct {
	major, minor uint32
	mntIDOld     uint64
}

// parseStatmount reads the sb_dev and mnt_id_old fields of struct
// statmount (STATMOUNT_SB_BASIC and STATMOUNT_MNT_BASIC).
func parseStatmount(b []byte) (statmount, error) {
	if len(b) < 64 {
		return statmount{}, fmt.Errorf("statmount: %d bytes, want at least 64", len(b))
	}
	ne := binary.NativeEndian
	if mask := ne.Uint64(b[8:]); mask&(statmountSBBasic|statmountMntBasic) != statmountSBBasic|statmountMntBasic {
		return statmount{}, fmt.Errorf("statmount: mask %#x lacks the superblock or mount basics", mask)
	}
	return statmount{major: ne.Uint32(b[16:]), minor: ne.Uint32(b[20:]), mntIDOld: uint64(ne.Uint32(b[56:]))}, nil
}
