package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/testutil"
)

func TestHostStatPath(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	for _, fsType := range []string{Ext4, XFS} {
		t.Run(fsType, func(t *testing.T) {
			size := int64(64 * mib)
			if fsType == XFS {
				size = 320 * mib
			}
			dev, _, mnt := mounted(t, fsType, size)
			var dst unix.Stat_t
			if err := unix.Stat(dev, &dst); err != nil {
				t.Fatal(err)
			}
			st, err := StatPath(mnt)
			if err != nil {
				t.Fatal(err)
			}
			if !st.MountRoot || st.Major != unix.Major(dst.Rdev) || st.Minor != unix.Minor(dst.Rdev) || st.FSType != fsType || !st.Dir {
				t.Fatalf("StatPath(mount of %s) = %+v, want mount root of %d:%d, %s", dev, st, unix.Major(dst.Rdev), unix.Minor(dst.Rdev), fsType)
			}

			// A directory inside the filesystem: same device, not a
			// mount root, another inode.
			sub := filepath.Join(mnt, "sub")
			if err := os.Mkdir(sub, 0o755); err != nil {
				t.Fatal(err)
			}
			in, err := StatPath(sub)
			if err != nil {
				t.Fatal(err)
			}
			if in.MountRoot || in.Major != st.Major || in.Minor != st.Minor || in.Ino == st.Ino {
				t.Fatalf("StatPath(dir in mount) = %+v, root is %+v", in, st)
			}

			// A bind of that directory elsewhere is a mount root of
			// the same device: only the inode tells it from the
			// filesystem's root.
			other := t.TempDir()
			if err := unix.Mount(sub, other, "", unix.MS_BIND, ""); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Unmount(other, unix.MNT_DETACH) })
			b, err := StatPath(other)
			if err != nil {
				t.Fatal(err)
			}
			if !b.MountRoot || b.Major != st.Major || b.Ino != in.Ino {
				t.Fatalf("StatPath(bind of dir) = %+v, want mount root with inode %d", b, in.Ino)
			}

			// The directory under the mount, on the host's filesystem.
			if err := unix.Unmount(other, 0); err != nil {
				t.Fatal(err)
			}
			h, err := StatPath(other)
			if err != nil {
				t.Fatal(err)
			}
			if h.MountRoot || (h.Major == st.Major && h.Minor == st.Minor) {
				t.Fatalf("StatPath(bare dir) = %+v, must not look like the volume %+v", h, st)
			}
		})
	}

	// A symbolic link is described, not followed.
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink("/", link); err != nil {
		t.Fatal(err)
	}
	if l, err := StatPath(link); err != nil || l.MountRoot || l.Dir {
		t.Fatalf("StatPath(symlink to /) = %+v, %v; want a non-directory, not a mount root", l, err)
	}
	if _, err := StatPath(filepath.Join(dir, "missing")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("StatPath(missing) = %v, want ErrNotFound", err)
	}
}

// fsIOCShutdown is XFS_IOC_GOINGDOWN, which ext4 answers too
// (EXT4_IOC_SHUTDOWN): _IOR('X', 125, __u32). goingDownNoLogFlush stops
// the filesystem without writing its log, as a lost device would.
const (
	fsIOCShutdown       = 0x8004587d
	goingDownNoLogFlush = 2
)

// shutDown stops the filesystem mounted at p as I/O errors would.
func shutDown(t *testing.T, p string) {
	t.Helper()
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.IoctlSetPointerInt(fd, fsIOCShutdown, goingDownNoLogFlush); err != nil {
		t.Fatalf("shut down %s: %v", p, err)
	}
}

// A shut-down xfs answers getattr with EIO: its mount is still described
// (the same device, inode, mount ID and type as before) and unmounted by
// what the check sees, with the device from statmount or, on kernels
// without it (nor openat2, whose fallback opens each component), from
// the mount table. ext4 keeps answering getattr after a shutdown.
func TestHostStatShutDown(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	for _, fsType := range []string{Ext4, XFS} {
		for _, viaMountinfo := range []bool{false, true} {
			name := fsType + "/statmount"
			if viaMountinfo {
				name = fsType + "/mountinfo"
			}
			t.Run(name, func(t *testing.T) {
				if viaMountinfo {
					was := noStatmount.Swap(true)
					defer noStatmount.Store(was)
					was2 := noOpenat2.Swap(true)
					defer noOpenat2.Store(was2)
				}
				testStatShutDown(t, fsType, viaMountinfo)
			})
		}
	}
}

func testStatShutDown(t *testing.T, fsType string, viaMountinfo bool) {
	size := int64(64 * mib)
	if fsType == XFS {
		size = 320 * mib
	}
	_, _, mnt := mounted(t, fsType, size)
	before, err := StatPath(mnt)
	if err != nil {
		t.Fatal(err)
	}
	shutDown(t, mnt)

	hadStatmount := !noStatmount.Load()
	reads := MountTableReads()
	after, err := StatPath(mnt)
	if err != nil {
		t.Fatalf("StatPath(shut-down %s): %v", fsType, err)
	}
	if fsType == XFS {
		if !errors.Is(after.FSError, unix.EIO) {
			t.Errorf("StatPath(shut-down xfs).FSError = %v, want EIO", after.FSError)
		}
		switch n := MountTableReads() - reads; {
		case viaMountinfo && n != 1:
			t.Errorf("StatPath(shut-down xfs) read the mount table %d times, want once", n)
		case !viaMountinfo && hadStatmount && !noStatmount.Load() && n != 0:
			t.Errorf("StatPath(shut-down xfs) with statmount read the mount table %d times", n)
		case !viaMountinfo && noStatmount.Load():
			t.Logf("the kernel has no statmount or unique mount IDs: the mount table was read")
		}
	}
	if fsType == Ext4 && after.FSError != nil {
		t.Errorf("StatPath(shut-down ext4).FSError = %v, want nil (ext4 answers getattr)", after.FSError)
	}
	after.FSError = nil
	if after != before {
		t.Errorf("StatPath(shut-down %s) = %+v, before the shutdown %+v", fsType, after, before)
	}

	dir, name, err := OpenParent(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	var seen PathStat
	if err := UnmountAt(dir, name, func(st PathStat) error {
		if st.Major != before.Major || st.Minor != before.Minor || st.Ino != before.Ino {
			return fmt.Errorf("%+v is not the shut-down mount %+v", st, before)
		}
		seen = st
		return nil
	}); err != nil {
		t.Fatalf("UnmountAt(shut-down %s): %v", fsType, err)
	}
	if !seen.MountRoot {
		t.Errorf("the check saw %+v, not a mount root", seen)
	}
	if ok, err := IsMountPoint(mnt); err != nil || ok {
		t.Fatalf("after UnmountAt: IsMountPoint = %v, %v; want unmounted", ok, err)
	}
}
