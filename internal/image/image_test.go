package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// tree makes a small root: directories, a setuid file, a symlink, a hard
// link; files are created in the order given, which differs between calls
// so that directory order on disk differs too.
func tree(t *testing.T, order []string) string {
	t.Helper()
	root := t.TempDir()
	for _, n := range order {
		p := filepath.Join(root, n)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		switch n {
		case "bin/sh":
			if err := os.Symlink("dash", p); err != nil {
				t.Fatal(err)
			}
		case "sbin/mkfs.ext4":
			if err := os.Link(filepath.Join(root, "sbin/mke2fs"), p); err != nil {
				t.Fatal(err)
			}
		default:
			if err := os.WriteFile(p, []byte("content of "+n), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.Chmod(filepath.Join(root, "bin/mount"), 0o755|os.ModeSetuid); err != nil {
		t.Fatal(err)
	}
	// Different times on each tree: the layer must not show them.
	now := time.Now().Add(-time.Duration(len(order[0])) * time.Hour)
	filepath.Walk(root, func(p string, _ os.FileInfo, _ error) error {
		os.Chtimes(p, now, now)
		return nil
	})
	return root
}

func options(t *testing.T, root string) Options {
	bin := filepath.Join(t.TempDir(), "berth")
	if err := os.WriteFile(bin, []byte("\x7fELF berth"), 0o600); err != nil {
		t.Fatal(err)
	}
	return Options{
		Root: root, Add: []File{{Source: bin, Path: "/usr/local/bin/berth", Mode: 0o755}},
		Name: "berth", Tag: "v1.2.3", Epoch: time.Unix(1700000000, 0),
		Entrypoint: []string{"/usr/local/bin/berth"}, Cmd: []string{"serve"},
	}
}

func archive(t *testing.T, o Options) ([]byte, Result) {
	t.Helper()
	var b bytes.Buffer
	res, err := Write(&b, o)
	if err != nil {
		t.Fatal(err)
	}
	return b.Bytes(), res
}

// Two builds from equal trees made differently give the same bytes, and
// the archive verifies.
func TestReproducible(t *testing.T) {
	a, ra := archive(t, options(t, tree(t, []string{"bin/dash", "bin/mount", "sbin/mke2fs", "sbin/mkfs.ext4", "bin/sh", "etc/passwd"})))
	b, rb := archive(t, options(t, tree(t, []string{"etc/passwd", "sbin/mke2fs", "bin/mount", "bin/dash", "bin/sh", "sbin/mkfs.ext4"})))
	if !bytes.Equal(a, b) || ra != rb {
		t.Fatalf("two builds differ: %+v and %+v", ra, rb)
	}
	refs, err := Verify(bytes.NewReader(a))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(refs, []string{"berth:v1.2.3"}) {
		t.Fatalf("references %v", refs)
	}
	// Another epoch is another image.
	o := options(t, tree(t, []string{"bin/dash", "bin/mount", "sbin/mke2fs", "sbin/mkfs.ext4", "bin/sh", "etc/passwd"}))
	o.Epoch = o.Epoch.Add(time.Second)
	if _, rc := archive(t, o); rc.ManifestDigest == ra.ManifestDigest {
		t.Fatal("the epoch does not change the image")
	}
}

// files returns the regular files of a tar by name.
func files(t *testing.T, b []byte) (map[string][]byte, []*tar.Header) {
	t.Helper()
	out := map[string][]byte{}
	var hs []*tar.Header
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out, hs
		}
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
		data, _ := io.ReadAll(tr)
		out[h.Name] = data
	}
}

// The layer holds the tree as the runtime must unpack it.
func TestLayer(t *testing.T) {
	a, res := archive(t, options(t, tree(t, []string{"bin/dash", "bin/mount", "sbin/mke2fs", "sbin/mkfs.ext4", "bin/sh", "etc/passwd"})))
	outer, _ := files(t, a)
	layer, hs := files(t, outer[blobPath(res.LayerDigest)])
	var names []string
	byName := map[string]*tar.Header{}
	for _, h := range hs {
		names = append(names, h.Name)
		byName[h.Name] = h
		if !h.ModTime.Equal(time.Unix(1700000000, 0)) || h.Uname != "" || h.Gname != "" || !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() {
			t.Errorf("%s: time %v, owner names %q %q, atime %v, ctime %v", h.Name, h.ModTime, h.Uname, h.Gname, h.AccessTime, h.ChangeTime)
		}
	}
	if !slices.IsSorted(names) {
		t.Errorf("entries not sorted: %v", names)
	}
	want := []string{"bin/", "bin/dash", "bin/mount", "bin/sh", "etc/", "etc/passwd", "sbin/", "sbin/mke2fs", "sbin/mkfs.ext4", "usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/berth"}
	if !slices.Equal(names, want) {
		t.Fatalf("entries %v, want %v", names, want)
	}
	if h := byName["bin/sh"]; h.Typeflag != tar.TypeSymlink || h.Linkname != "dash" {
		t.Errorf("bin/sh: %+v", h)
	}
	if h := byName["sbin/mkfs.ext4"]; h.Typeflag != tar.TypeLink || h.Linkname != "sbin/mke2fs" {
		t.Errorf("sbin/mkfs.ext4 is not a hard link to sbin/mke2fs: %+v", h)
	}
	if h := byName["bin/mount"]; h.Mode != 0o4755 {
		t.Errorf("bin/mount mode %o, want 4755", h.Mode)
	}
	if h := byName["usr/local/bin/berth"]; h.Mode != 0o755 || string(layer["usr/local/bin/berth"]) != "\x7fELF berth" {
		t.Errorf("berth: mode %o, content %q", h.Mode, layer["usr/local/bin/berth"])
	}

	// docker save's manifest.json and the OCI index agree.
	var docker []DockerManifest
	if err := json.Unmarshal(outer["manifest.json"], &docker); err != nil {
		t.Fatal(err)
	}
	if len(docker) != 1 || docker[0].Config != blobPath(res.ConfigDigest) || !slices.Equal(docker[0].RepoTags, []string{"berth:v1.2.3"}) {
		t.Errorf("manifest.json %s", outer["manifest.json"])
	}
	var index Index
	if err := json.Unmarshal(outer["index.json"], &index); err != nil {
		t.Fatal(err)
	}
	if a := index.Manifests[0].Annotations; a["io.containerd.image.name"] != "docker.io/library/berth:v1.2.3" || a["org.opencontainers.image.ref.name"] != "v1.2.3" {
		t.Errorf("index.json annotations %v", a)
	}
	var cfg Config
	if err := json.Unmarshal(outer[blobPath(res.ConfigDigest)], &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Created != "2023-11-14T22:13:20Z" || !slices.Equal(cfg.Config.Entrypoint, []string{"/usr/local/bin/berth"}) {
		t.Errorf("config %+v", cfg)
	}
}

// Verify catches what an importer would refuse.
func TestVerifyRefuses(t *testing.T) {
	a, res := archive(t, options(t, tree(t, []string{"bin/dash", "bin/mount", "sbin/mke2fs", "sbin/mkfs.ext4", "bin/sh", "etc/passwd"})))
	rewrite := func(change func(name string, data []byte) []byte) []byte {
		outer, hs := files(t, a)
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range hs {
			data := outer[h.Name]
			if h.Typeflag == tar.TypeReg {
				data = change(h.Name, data)
				h.Size = int64(len(data))
			}
			tw.WriteHeader(h)
			tw.Write(data)
		}
		tw.Close()
		return b.Bytes()
	}
	for name, tc := range map[string]struct {
		change func(string, []byte) []byte
		want   string
	}{
		"a layer byte changed": {func(n string, d []byte) []byte {
			if n == blobPath(res.LayerDigest) {
				d = slices.Clone(d)
				d[600] ^= 1
			}
			return d
		}, "blob " + res.LayerDigest},
		"diff_id wrong": {func(n string, d []byte) []byte {
			if n == blobPath(res.ConfigDigest) {
				return bytes.Replace(d, []byte(res.LayerDigest), []byte("sha256:"+strings.Repeat("0", 64)), 1)
			}
			return d
		}, "blob " + res.ConfigDigest},
		"no RepoTags": {func(n string, d []byte) []byte {
			if n == "manifest.json" {
				return bytes.Replace(d, []byte(`["berth:v1.2.3"]`), []byte(`[]`), 1)
			}
			return d
		}, "RepoTags"},
		"no oci-layout": {func(n string, d []byte) []byte {
			if n == "oci-layout" {
				return []byte("{}")
			}
			return d
		}, "oci-layout"},
	} {
		if _, err := Verify(bytes.NewReader(rewrite(tc.change))); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Verify = %v, want an error naming %q", name, err, tc.want)
		}
	}
}

func TestQualified(t *testing.T) {
	for in, want := range map[string]string{
		"berth:v1":                   "docker.io/library/berth:v1",
		"me/berth:v1":                "docker.io/me/berth:v1",
		"registry.example/berth:v1":  "registry.example/berth:v1",
		"localhost:5000/berth:v1":    "localhost:5000/berth:v1",
		"localhost/berth:v1":         "localhost/berth:v1",
		"ghcr.io/berth-csi/berth:v1": "ghcr.io/berth-csi/berth:v1",
	} {
		if got := qualified(in); got != want {
			t.Errorf("qualified(%q) = %q, want %q", in, got, want)
		}
	}
}
