package agent

import (
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzValidatePath: an accepted path is absolute, clean, printable, and
// cannot climb out of where it says it is.
func FuzzValidatePath(f *testing.F) {
	for _, s := range []string{"/a/b", "", "a", "/a/../b", "//a", "/a/", "/a\x00", "/a\nb", "/$(x)", "/\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if err := validatePath("target_path", p); err != nil {
			return
		}
		if !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/" || hasControl(p) || !utf8.ValidString(p) {
			t.Fatalf("accepted %q", p)
		}
		for _, elem := range strings.Split(p, "/") {
			if elem == ".." || elem == "." {
				t.Fatalf("accepted %q with a %q element", p, elem)
			}
		}
	})
}

// FuzzVolumeContext: volume_context parsing never panics, and an image
// it accepts is below the file root.
func FuzzVolumeContext(f *testing.F) {
	f.Add("file", "a.img", "transport", "file")
	f.Add("file", "../../etc/passwd", "", "")
	f.Add("nqn", "nqn.x", "iqn", "iqn.y")
	f.Add("file", "/etc/passwd", "transport", "file")
	f.Add("file", "a/./../../b", "x", "\x00")
	root := f.TempDir()
	ft, err := NewFileTransport(root, nil)
	if err != nil {
		f.Fatal(err)
	}
	ts := map[string]Transport{"file": ft}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		vc, err := mergeContext(map[string]string{k1: v1}, map[string]string{k2: v2})
		if err != nil {
			return
		}
		for k, v := range vc {
			if hasControl(k) || hasControl(v) {
				t.Fatalf("accepted control characters in %q=%q", k, v)
			}
		}
		tr, err := selectTransport(vc, ts)
		if err != nil {
			return
		}
		tg, err := tr.Parse(vc, nil)
		if err != nil {
			return
		}
		key := tg.Key()
		if !strings.HasPrefix(key, ft.root+"/") || filepath.Clean(key) != key {
			t.Fatalf("volume_context %v names %q, outside the root %s", vc, key, ft.root)
		}
	})
}

// FuzzStateFileName: every volume ID maps to a plain file name.
func FuzzStateFileName(f *testing.F) {
	f.Add("../../etc")
	f.Add("/")
	f.Fuzz(func(t *testing.T, id string) {
		name := stateFileName(id)
		if strings.ContainsAny(name, "/\x00") || name == "." || name == ".." || len(name) != 69 {
			t.Fatalf("state file name %q for %q", name, id)
		}
	})
}
