package file

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
