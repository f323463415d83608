package fs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/testutil"
)

// Both ways of resolving: openat2, and the walk with O_NOFOLLOW that
// berth falls back to where openat2 is refused (old kernels, systemd's
// RestrictSUIDSGID= seccomp filter).
func TestOpenPathRefusesSymlinks(t *testing.T) {
	t.Run("openat2", testOpenPathRefusesSymlinks)
	t.Run("component walk", func(t *testing.T) {
		was := noOpenat2.Swap(true)
		defer noOpenat2.Store(was)
		testOpenPathRefusesSymlinks(t)
		if _, err := OpenPath("/proc/self/root/etc"); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("OpenPath through /proc/self = %v, want ErrInvalidArgument", err)
		}
	})
}

func testOpenPathRefusesSymlinks(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "real")
	if err := os.Mkdir(real, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(real, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(real, "etc")); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]error{
		filepath.Join(dir, "real"):             nil,
		filepath.Join(dir, "link"):             errdefs.ErrInvalidArgument,
		filepath.Join(dir, "link", "x"):        errdefs.ErrInvalidArgument,
		filepath.Join(dir, "real", "etc"):      errdefs.ErrInvalidArgument,
		filepath.Join(dir, "missing"):          errdefs.ErrNotFound,
		filepath.Join(dir, "real", "etc", "x"): errdefs.ErrInvalidArgument,
	} {
		h, err := OpenPath(p)
		if (want == nil) != (err == nil) || (want != nil && !errors.Is(err, want)) {
			t.Errorf("OpenPath(%s) = %v, want %v", p, err, want)
		}
		h.Close()
	}
	d, name, err := OpenParent(filepath.Join(dir, "real", "etc"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.OpenAt(name); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("OpenAt(symlink) = %v, want ErrInvalidArgument", err)
	}
	for _, bad := range []string{"", ".", "..", "a/b"} {
		if _, err := d.OpenAt(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("OpenAt(%q) = %v, want ErrInvalidArgument", bad, err)
		}
	}
	if err := d.MkdirAt("new", 0o750); err != nil {
		t.Fatal(err)
	}
	if err := d.MkdirAt("new", 0o750); !errors.Is(err, os.ErrExist) {
		t.Errorf("second MkdirAt = %v, want ErrExist", err)
	}
	if err := d.CreateAt("etc", 0o600); !errors.Is(err, os.ErrExist) {
		t.Errorf("CreateAt over a symlink = %v, want ErrExist", err)
	}
	nd, err := d.OpenAt("new")
	if err != nil {
		t.Fatal(err)
	}
	defer nd.Close()
	if empty, err := nd.Empty(); err != nil || !empty {
		t.Errorf("Empty(new dir) = %v, %v", empty, err)
	}
	if err := nd.CreateAt("f", 0o600); err != nil {
		t.Fatal(err)
	}
	if empty, err := nd.Empty(); err != nil || empty {
		t.Errorf("Empty(dir with a file) = %v, %v", empty, err)
	}
	if err := d.RemoveAt("etc"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/etc/passwd"); err != nil {
		t.Fatalf("RemoveAt of a symlink touched its target: %v", err)
	}
}

// RemoveAt leaves a directory with entries and a mount point, and says so
// with ErrFailedPrecondition (the errno stays in the chain).
func TestHostRemoveAtRefusesNonEmptyAndMounted(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "full", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "mnt"), 0o755); err != nil {
		t.Fatal(err)
	}
	tmpfs(t, filepath.Join(dir, "mnt"))
	d, err := OpenPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for name, errno := range map[string]unix.Errno{"full": unix.ENOTEMPTY, "mnt": unix.EBUSY} {
		err := d.RemoveAt(name)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !errors.Is(err, errno) {
			t.Errorf("RemoveAt(%s) = %v, want ErrFailedPrecondition and %v", name, err, errno)
		}
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("RemoveAt(%s) removed it: %v", name, err)
		}
	}
}

// FileID is the device and inode pair stat reports, shared by hard links.
func TestFileID(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	if err := os.WriteFile(a, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(a, b); err != nil {
		t.Fatal(err)
	}
	fa, err := os.Lstat(a)
	if err != nil {
		t.Fatal(err)
	}
	fb, err := os.Lstat(b)
	if err != nil {
		t.Fatal(err)
	}
	da, ia, ok := FileID(fa)
	db, ib, okb := FileID(fb)
	if want := devIno(t, a); !ok || !okb || [2]uint64{da, ia} != want || da != db || ia != ib {
		t.Errorf("FileID = %d/%d (%v), %d/%d (%v); want %v for both links", da, ia, ok, db, ib, okb, want)
	}
}

func tmpfs(t *testing.T, at string) {
	t.Helper()
	if err := unix.Mount("tmpfs", at, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for unix.Unmount(at, unix.MNT_DETACH) == nil {
		}
	})
}

func devIno(t *testing.T, p string) [2]uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return [2]uint64{st.Dev, st.Ino}
}

// UnmountAt acts in the directory it was given, not in what the
// directory's path leads to by the time it unmounts.
func TestHostUnmountAtHeldDirectory(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dir := t.TempDir()
	mine, other := filepath.Join(dir, "mine"), filepath.Join(dir, "other")
	for _, p := range []string{filepath.Join(mine, "x"), filepath.Join(other, "x")} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		tmpfs(t, p)
	}
	a, b := devIno(t, filepath.Join(mine, "x")), devIno(t, filepath.Join(other, "x"))
	d, name, err := OpenParent(filepath.Join(mine, "x"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// The checked directory's name now leads to the other one.
	if err := os.Rename(mine, mine+"-old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, mine); err != nil {
		t.Fatal(err)
	}
	var seen PathStat
	if err := UnmountAt(d, name, func(st PathStat) error { seen = st; return nil }); err != nil {
		t.Fatal(err)
	}
	if uint64(unix.Mkdev(seen.Major, seen.Minor)) != a[0] {
		t.Errorf("check saw device %d:%d, not the held directory's mount", seen.Major, seen.Minor)
	}
	if ok, err := IsMountPoint(filepath.Join(mine+"-old", "x")); err != nil || ok {
		t.Errorf("the held directory's mount: IsMountPoint = %v, %v; want unmounted", ok, err)
	}
	if devIno(t, filepath.Join(other, "x")) != b {
		t.Error("the mount the symlink leads to was unmounted")
	}
	// A symlink at the name itself is not followed.
	if err := os.Symlink(filepath.Join(other, "x"), filepath.Join(mine+"-old", "y")); err != nil {
		t.Fatal(err)
	}
	if err := UnmountAt(d, "y", nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("UnmountAt(symlink) = %v, want ErrInvalidArgument", err)
	}
	if devIno(t, filepath.Join(other, "x")) != b {
		t.Error("UnmountAt followed a symlink at the name")
	}
}

// UnmountAt asks check about each mount before unmounting it: a refused
// mount on top stops it with nothing unmounted; a refused mount further
// down is left in place.
func TestHostUnmountAtChecks(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dir := t.TempDir()
	x := filepath.Join(dir, "x")
	if err := os.Mkdir(x, 0o755); err != nil {
		t.Fatal(err)
	}
	tmpfs(t, x)
	lower := devIno(t, x)
	tmpfs(t, x)
	upper := devIno(t, x)
	d, name, err := OpenParent(x)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	refuse := errors.New("not this one")
	only := func(want [2]uint64) func(PathStat) error {
		return func(st PathStat) error {
			if uint64(unix.Mkdev(st.Major, st.Minor)) != want[0] || st.Ino != want[1] {
				return refuse
			}
			return nil
		}
	}
	if err := UnmountAt(d, name, only(lower)); !errors.Is(err, refuse) {
		t.Fatalf("UnmountAt refusing the top mount = %v", err)
	}
	if devIno(t, x) != upper {
		t.Fatal("a refused mount was unmounted")
	}
	if err := UnmountAt(d, name, only(upper)); err != nil {
		t.Fatal(err)
	}
	if devIno(t, x) != lower {
		t.Fatal("UnmountAt went past the mount check refused")
	}
	if err := UnmountAt(d, name, nil); err != nil {
		t.Fatal(err)
	}
	if ok, err := IsMountPoint(x); err != nil || ok {
		t.Fatalf("after UnmountAt: IsMountPoint = %v, %v", ok, err)
	}
	if err := UnmountAt(d, "missing", nil); err != nil {
		t.Errorf("UnmountAt(missing) = %v", err)
	}
}

func TestHostBindMountAt(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	for _, p := range []string{src, dst} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	tmpfs(t, src)
	s, err := OpenPath(src)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	d, name, err := OpenParent(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	tg, err := d.OpenAt(name)
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	if err := BindMountAt(s, tg, true, MS_NOEXEC); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dst, unix.MNT_DETACH) })
	if devIno(t, dst) != devIno(t, src) {
		t.Fatal("target does not show the source")
	}
	if err := os.WriteFile(filepath.Join(dst, "f"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write through the read-only bind: %v, want EROFS", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dst, &sfs); err != nil || statfsFlags(sfs)&MS_NOEXEC == 0 {
		t.Errorf("flags of the bind: %#x, %v; want noexec", statfsFlags(sfs), err)
	}
	if err := UnmountAt(d, name, nil); err != nil {
		t.Fatal(err)
	}
	if ok, _ := IsMountPoint(dst); ok {
		t.Fatal("bind still mounted")
	}
}

// Why UnmountAt unmounts at a name in the held directory and not through
// a descriptor of the mount itself: umount2 on /proc/self/fd/N with
// UMOUNT_NOFOLLOW looks at the link (EINVAL), and without it the open
// descriptor keeps the mount busy (EBUSY). Neither unmounts anything.
func TestHostUnmountThroughMountDescriptor(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	x := filepath.Join(t.TempDir(), "x")
	if err := os.Mkdir(x, 0o755); err != nil {
		t.Fatal(err)
	}
	tmpfs(t, x)
	h, err := OpenPath(x)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := unix.Unmount(h.procPath(), unix.UMOUNT_NOFOLLOW); !errors.Is(err, unix.EINVAL) {
		t.Errorf("umount2(/proc/self/fd/N, UMOUNT_NOFOLLOW) = %v, want EINVAL", err)
	}
	if err := unix.Unmount(h.procPath(), 0); !errors.Is(err, unix.EBUSY) {
		t.Errorf("umount2(/proc/self/fd/N) with N open = %v, want EBUSY", err)
	}
	if ok, err := IsMountPoint(x); err != nil || !ok {
		t.Fatalf("IsMountPoint = %v, %v; want still mounted", ok, err)
	}
}

// OpenFile opens what the Handle resolved, not what is at its name now,
// and only a regular file.
func TestHandleOpenFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "a")
	if err := os.WriteFile(p, []byte("first"), 0o600); err != nil {
		t.Fatal(err)
	}
	h, err := OpenPath(p)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	// The name now holds another file.
	if err := os.Rename(p, p+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("second"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := h.OpenFile(os.O_RDWR)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 16)
	n, _ := f.Read(b)
	f.Close()
	if string(b[:n]) != "first" {
		t.Errorf("OpenFile read %q, want the file the Handle resolved (%q)", b[:n], "first")
	}
	d, err := OpenPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if f, err := d.OpenFile(os.O_RDONLY); !errors.Is(err, errdefs.ErrInvalidArgument) {
		if f != nil {
			f.Close()
		}
		t.Errorf("OpenFile of a directory = %v, want ErrInvalidArgument", err)
	}
}
