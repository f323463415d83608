package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// countSyncs counts the store's fsyncs until the test ends.
func countSyncs(t *testing.T) *atomic.Int64 {
	t.Helper()
	var n atomic.Int64
	orig := syncFile
	syncFile = func(f *os.File) error {
		n.Add(1)
		return orig(f)
	}
	t.Cleanup(func() { syncFile = orig })
	return &n
}

// putVisible writes a volume's first record without fsyncs, and every
// later one with both; a record whose data the disk never got (an empty
// file, or zeros) is cleared when the store opens, while any other
// unreadable record still stops it.
func TestStatePutVisible(t *testing.T) {
	syncs := countSyncs(t)
	dir := filepath.Join(t.TempDir(), "volumes")
	s, err := openStore(dir)
	must(t, "openStore", err)
	rec := &volumeRecord{VolumeID: "v1", Transport: "file", StagingPath: "/s/1"}

	must(t, "putVisible", s.putVisible(rec))
	if n := syncs.Swap(0); n != 0 {
		t.Fatalf("first record: %d fsyncs, want 0", n)
	}
	s2, err := openStore(dir)
	must(t, "reopen", err)
	if r, ok := s2.get("v1"); !ok || r.StagingPath != "/s/1" {
		t.Fatalf("record written without fsync not seen on reopen: %+v %t", r, ok)
	}

	rec.Staged = true
	must(t, "putVisible of a known volume", s.putVisible(rec))
	if n := syncs.Swap(0); n != 2 {
		t.Fatalf("record replacing one on disk: %d fsyncs, want 2 (file and directory)", n)
	}
	must(t, "put", s.put(&volumeRecord{VolumeID: "v2", Transport: "file"}))
	if n := syncs.Swap(0); n != 2 {
		t.Fatalf("put: %d fsyncs, want 2", n)
	}

	empty := filepath.Join(dir, stateFileName("v3"))
	must(t, "write empty", os.WriteFile(empty, nil, 0o600))
	s3, err := openStore(dir)
	must(t, "open with an empty record", err)
	if _, err := os.Stat(empty); !os.IsNotExist(err) {
		t.Fatalf("empty record not removed: %v", err)
	}
	if len(s3.cleared) != 1 || s3.cleared[0] != stateFileName("v3") {
		t.Fatalf("cleared %q", s3.cleared)
	}
	if s3.count() != 2 {
		t.Fatalf("%d records, want 2", s3.count())
	}
	must(t, "write zeros", os.WriteFile(empty, make([]byte, 300), 0o600))
	if _, err := openStore(dir); err != nil {
		t.Fatalf("open with a record of zeros: %v", err)
	}
	if _, err := os.Stat(empty); !os.IsNotExist(err) {
		t.Fatalf("record of zeros not removed: %v", err)
	}
	must(t, "write torn", os.WriteFile(empty, []byte("{"), 0o600))
	if _, err := openStore(dir); err == nil {
		t.Fatal("a record that does not parse was loaded or dropped")
	}
}

// A new volume's first record is fsynced before the attach unless its
// target says a reboot undoes the attach; the records after it always
// are.
func TestStageIntentSync(t *testing.T) {
	for _, tc := range []struct {
		rebootClears bool
		want         int64
	}{
		{false, 6}, // intent, formatting mark, staged: file and directory each
		{true, 4},
	} {
		a, _, ft := newFakeAgent(t)
		ft.rebootClears = tc.rebootClears
		ns := &nodeServer{a: a}
		staging := filepath.Join(t.TempDir(), "v1")
		must(t, "mkdir", os.Mkdir(staging, 0o750))
		syncs := countSyncs(t)
		if _, err := ns.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
			VolumeId: "v1", StagingTargetPath: staging,
			VolumeContext:    map[string]string{"transport": "fake", "fake": "7"},
			VolumeCapability: mountCap("ext4", snw),
		}); err != nil {
			t.Fatal(err)
		}
		if n := syncs.Load(); n != tc.want {
			t.Errorf("reboot clears attach %t: %d fsyncs in a stage that formats, want %d", tc.rebootClears, n, tc.want)
		}
		s, err := openStore(a.state.dir)
		must(t, "reopen", err)
		if r, ok := s.get("v1"); !ok || !r.Staged || r.Formatting != nil {
			t.Errorf("reboot clears attach %t: record on reopen %+v %t", tc.rebootClears, r, ok)
		}
	}
}

// Volume IDs never become paths: "../../etc" stays inside the state dir
// and comes back under its own ID.
func TestStateEncoding(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "volumes")
	s, err := openStore(dir)
	must(t, "openStore", err)
	ids := []string{"../../etc", "/", "a/b", ".", "..", "pvc-1", strings.Repeat("z", 128)}
	for _, id := range ids {
		must(t, "put", s.put(&volumeRecord{VolumeID: id, Transport: "file", Context: map[string]string{"file": "x"}, StagingPath: "/s/" + fmt.Sprint(len(id))}))
	}
	entries, err := os.ReadDir(dir)
	must(t, "readdir", err)
	if len(entries) != len(ids) {
		t.Fatalf("%d files for %d volumes", len(entries), len(ids))
	}
	for _, e := range entries {
		if !e.Type().IsRegular() || len(e.Name()) != 64+len(".json") {
			t.Fatalf("unexpected state entry %q", e.Name())
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "etc")); err == nil {
		t.Fatal("a volume ID escaped the state directory")
	}
	s2, err := openStore(dir)
	must(t, "reopen", err)
	for _, id := range ids {
		r, ok := s2.get(id)
		if !ok || r.VolumeID != id || r.Context["file"] != "x" {
			t.Fatalf("volume %q not reloaded: %+v", id, r)
		}
	}
	if owner, ok := s2.pathOwner("/s/9"); !ok || owner != "../../etc" {
		t.Fatalf("pathOwner: %q %t", owner, ok)
	}
	must(t, "remove", s2.remove("../../etc"))
	must(t, "remove twice", s2.remove("../../etc"))
	if _, ok := s2.get("../../etc"); ok {
		t.Fatal("removed record still there")
	}
	// A stale temporary file from a crash is cleaned, a misplaced record
	// refuses to load.
	must(t, "write tmp", os.WriteFile(filepath.Join(dir, ".tmp-x.json-1"), []byte("{"), 0o600))
	if _, err := openStore(dir); err != nil {
		t.Fatalf("open with a stale temp file: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".tmp-x.json-1")); err == nil {
		t.Fatal("stale temp file not removed")
	}
	must(t, "write misplaced", os.WriteFile(filepath.Join(dir, stateFileName("other")), []byte(`{"volumeID":"pvc-1"}`), 0o600))
	if _, err := openStore(dir); err == nil {
		t.Fatal("a record under another volume's file name was loaded")
	}
}

func TestStateClone(t *testing.T) {
	r := &volumeRecord{VolumeID: "v", Context: map[string]string{"a": "b"}, Publishes: map[string]publishRecord{"/t": {}}, Device: &deviceRecord{Name: "loop0"}}
	c := r.clone()
	c.Context["a"] = "x"
	c.Publishes["/u"] = publishRecord{}
	c.Device.Name = "loop1"
	if r.Context["a"] != "b" || len(r.Publishes) != 1 || r.Device.Name != "loop0" {
		t.Fatal("clone shares memory with the original")
	}
}
