package fs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestHostStatPath(t *testing.T) {
	needRoot(t)
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
