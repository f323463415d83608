package agent

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// A byte-for-byte copy of an xfs volume (a clone, a restored snapshot)
// stages on the node where its origin is staged, and the two stay
// independent.
func TestXFSCloneOnSameNode(t *testing.T) {
	h := newHarness(t)
	a := h.newVol("origin", 300*mib, mountCap("xfs", snw))
	must(t, "stage origin", h.stage(a))
	must(t, "publish origin", h.publish(a, false))
	must(t, "write origin", os.WriteFile(filepath.Join(a.target, "shared"), []byte("written before the clone"), 0o644))
	must(t, "unpublish origin", h.unpublish(a))
	must(t, "unstage origin", h.unstage(a))

	copyFile(t, filepath.Join(h.root, "origin.img"), filepath.Join(h.root, "clone.img"))
	b := vol{
		id: "vol-clone", staging: h.mkdir("staging/clone"), target: filepath.Join(h.mkdir("pods/clone"), "mount"),
		vctx: map[string]string{"file": "clone.img"}, cap: a.cap,
	}
	must(t, "restage origin", h.stage(a))
	must(t, "publish origin", h.publish(a, false))
	must(t, "stage clone beside its origin", h.stage(b))
	must(t, "publish clone", h.publish(b, false))

	for _, v := range []vol{a, b} {
		got, err := os.ReadFile(filepath.Join(v.target, "shared"))
		if err != nil || string(got) != "written before the clone" {
			t.Fatalf("%s: shared file %q, %v", v.id, got, err)
		}
		must(t, "write "+v.id, os.WriteFile(filepath.Join(v.target, "own"), []byte(v.id), 0o644))
	}
	for _, v := range []vol{a, b} {
		got, err := os.ReadFile(filepath.Join(v.target, "own"))
		if err != nil || !bytes.Equal(got, []byte(v.id)) {
			t.Fatalf("%s: own file %q, %v; the volumes are not independent", v.id, got, err)
		}
	}
	for _, v := range []vol{a, b} {
		must(t, "unpublish "+v.id, h.unpublish(v))
		must(t, "unstage "+v.id, h.unstage(v))
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	src, err := os.Open(from)
	must(t, "open", err)
	defer src.Close()
	dst, err := os.Create(to)
	must(t, "create", err)
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	must(t, "close", dst.Close())
}
