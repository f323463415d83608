package file

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

func newTransport(t testing.TB, root string) *Transport {
	t.Helper()
	ft, err := New(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ft
}

func TestNew(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "a.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "relative", filepath.Join(dir, "missing"), img} {
		if _, err := New(bad, nil); err == nil {
			t.Errorf("New(%q) accepted", bad)
		}
	}
	// A root reached through a symbolic link is resolved once.
	link := filepath.Join(dir, "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	if ft := newTransport(t, link); ft.root != real {
		t.Errorf("root %q, want %q", ft.root, real)
	}
}

func TestParse(t *testing.T) {
	ft := newTransport(t, t.TempDir())
	root := ft.root
	for _, tc := range []struct {
		file, want string
	}{
		{"a.img", root + "/a.img"},
		{"dir/a.img", root + "/dir/a.img"},
		{root + "/a.img", root + "/a.img"},
		{"./a.img", root + "/a.img"},
		{"../a.img", ""},
		{"dir/../../a.img", ""},
		{"dir/../a.img", ""},
		{"/etc/passwd", ""},
		{root, ""},
		{root + "x/a.img", ""},
		{"", ""},
		{"a\nb", ""},
		{strings.Repeat("n", 255), root + "/" + strings.Repeat("n", 255)},
		{strings.Repeat("n", 256), ""},
		{"dir/" + strings.Repeat("n", 256) + "/a.img", ""},
		{strings.Repeat("d/", 2100) + "a.img", ""},
	} {
		tg, err := ft.Parse(map[string]string{KeyFile: tc.file}, nil)
		if tc.want == "" {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Parse(%q) = %v, want ErrInvalidArgument", tc.file, err)
			}
			continue
		}
		if err != nil || tg.Key() != tc.want {
			t.Errorf("Parse(%q) = %v, want key %q", tc.file, err, tc.want)
		}
	}
}

// Two names of one image (hard links) have one identity; a name through
// a symbolic link, or of something other than a regular file, has none;
// a missing image is ErrNotFound.
func TestIdentity(t *testing.T) {
	ft := newTransport(t, t.TempDir())
	write := func(name string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(ft.root, name), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	identity := func(name string) (string, error) {
		t.Helper()
		tg, err := ft.Parse(map[string]string{KeyFile: name}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return tg.Identity()
	}
	write("a.img")
	write("other.img")
	if err := os.Link(filepath.Join(ft.root, "a.img"), filepath.Join(ft.root, "b.img")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("a.img", filepath.Join(ft.root, "link.img")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(ft.root, "dir.img"), 0o700); err != nil {
		t.Fatal(err)
	}
	a, err := identity("a.img")
	if err != nil || !strings.HasPrefix(a, "file inode ") {
		t.Fatalf("identity of a.img: %q, %v", a, err)
	}
	if b, err := identity("b.img"); err != nil || b != a {
		t.Errorf("hard link b.img: %q, %v; want %q", b, err, a)
	}
	if o, err := identity("other.img"); err != nil || o == a {
		t.Errorf("other.img: %q, %v; want an identity other than %q", o, err, a)
	}
	for _, name := range []string{"link.img", "dir.img"} {
		if id, err := identity(name); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %q, %v; want ErrInvalidArgument", name, id, err)
		}
	}
	if id, err := identity("gone.img"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("gone.img: %q, %v; want ErrNotFound", id, err)
	}
}

// FuzzParse: Parse never panics, and an image it accepts is a clean path
// below the root.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"a.img", "../../etc/passwd", "/etc/passwd", "a/./../../b", "dir//a.img", "\x00", ""} {
		f.Add(s)
	}
	ft := newTransport(f, f.TempDir())
	f.Fuzz(func(t *testing.T, v string) {
		tg, err := ft.Parse(map[string]string{KeyFile: v}, nil)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("Parse(%q): %v is not ErrInvalidArgument", v, err)
			}
			return
		}
		key := tg.Key()
		if !strings.HasPrefix(key, ft.root+"/") || filepath.Clean(key) != key || hasControl(key) {
			t.Fatalf("Parse(%q) names %q, outside the root %s", v, key, ft.root)
		}
	})
}

// Attach opens the image without following a symbolic link anywhere on
// the way: an image name that is one, or that leads through a directory
// that is one, is refused (InvalidArgument), and the file it points to
// gets no loop device.
func TestAttachFollowsNoSymlink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices)")
	}
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ft := newTransport(t, t.TempDir())
	ft.listener = l
	outsideDir := t.TempDir()
	outside := filepath.Join(outsideDir, "other.img")
	if err := os.WriteFile(outside, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(ft.root, "link.img")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outsideDir, filepath.Join(ft.root, "dir")); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"link.img", "dir/other.img"} {
		tg, err := ft.Parse(map[string]string{KeyFile: name}, nil)
		if err != nil {
			t.Fatal(err)
		}
		d, err := tg.Attach(context.Background())
		if d != nil {
			t.Cleanup(func() { _ = devices.DetachLoop(d) })
		}
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Attach(%s) = %v, %v; want ErrInvalidArgument", name, d, err)
		}
	}
	if d, err := l.Roots().FindLoop(outside); err == nil {
		t.Errorf("%s attached to the file outside the root", d.Path)
		_ = devices.DetachLoop(d)
	}
}

// An image replaced by a symbolic link to another file that has a loop
// device: Expand refuses, and never refreshes the capacity of that other
// device (which would take the other file's new size).
func TestExpandFollowsNoSymlink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices)")
	}
	ctx := context.Background()
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ft := newTransport(t, t.TempDir())
	ft.listener = l
	img := filepath.Join(ft.root, "a.img")
	outside := filepath.Join(t.TempDir(), "other.img")
	for _, p := range []string{img, outside} {
		if err := os.WriteFile(p, make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tg, err := ft.Parse(map[string]string{KeyFile: "a.img"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ours, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Detached by the image's name once it is renamed (ours is read under
	// the old one).
	t.Cleanup(func() {
		out, _ := exec.Command("losetup", "-j", img+".old", "-n", "-O", "NAME").Output()
		for _, d := range strings.Fields(string(out)) {
			if err := exec.Command("losetup", "--detach", d).Run(); err != nil {
				t.Errorf("cleanup: detach %s: %v", d, err)
			}
		}
		_ = devices.DetachLoop(ours)
	})
	// Someone else's loop device of the other file.
	out, err := exec.Command("losetup", "--find", "--show", "--", outside).Output()
	if err != nil {
		t.Fatal(err)
	}
	theirs := &devices.Device{Path: strings.TrimSpace(string(out))}
	theirs.Name = filepath.Base(theirs.Path)
	t.Cleanup(func() { _ = exec.Command("losetup", "--detach", theirs.Path).Run() })
	if err := os.Truncate(outside, 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(img, img+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, img); err != nil {
		t.Fatal(err)
	}
	size, err := tg.Expand(ctx)
	if err == nil {
		t.Errorf("Expand through a symbolic link = %d, nil; want an error", size)
	}
	cur, lerr := l.Roots().Lookup(theirs.Name)
	if lerr != nil {
		t.Fatal(lerr)
	}
	if cur.Size != 1<<20 {
		t.Errorf("Expand (%v) refreshed %s, the other file's loop device: %d bytes now", err, theirs.Path, cur.Size)
	}
	if abnormal, msg := tg.Health(ctx); !abnormal {
		t.Error("Health through a symbolic link: reported healthy")
	} else {
		t.Log(msg)
	}
}
