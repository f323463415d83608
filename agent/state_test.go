package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
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

// Every record is written with two fsyncs (file and directory). A record
// that cannot be read (an empty file, zeros, torn JSON) is kept at open
// and refuses its volume until it is restored or moved aside.
func TestStateUnreadableRecordKept(t *testing.T) {
	syncs := countSyncs(t)
	dir := filepath.Join(t.TempDir(), "volumes")
	s, err := openStore(dir)
	must(t, "openStore", err)
	must(t, "put", s.put(&volumeRecord{VolumeID: "v1", Transport: "file", StagingPath: "/s/1"}))
	if n := syncs.Swap(0); n != 2 {
		t.Fatalf("first record: %d fsyncs, want 2 (file and directory)", n)
	}
	good, err := os.ReadFile(filepath.Join(dir, stateFileName("v1")))
	must(t, "read", err)

	p := filepath.Join(dir, stateFileName("v3"))
	for _, damaged := range [][]byte{nil, make([]byte, 300), []byte("{")} {
		must(t, "write damaged", os.WriteFile(p, damaged, 0o600))
		s2, err := openStore(dir)
		if err != nil {
			t.Fatalf("open with the unreadable record %q: %v", damaged, err)
		}
		if b, err := os.ReadFile(p); err != nil || string(b) != string(damaged) {
			t.Fatalf("unreadable record %q not kept: %q, %v", damaged, b, err)
		}
		if _, ok := s2.damagedFiles()[p]; !ok || s2.count() != 2 {
			t.Fatalf("unreadable record %q: damaged %v, count %d", damaged, s2.damagedFiles(), s2.count())
		}
		_, _, err = s2.lookup("v3")
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), p) {
			t.Fatalf("lookup of the volume of the unreadable record %q: %v", damaged, err)
		}
		if _, ok, err := s2.lookup("v1"); !ok || err != nil {
			t.Fatalf("lookup of another volume: %t, %v", ok, err)
		}
	}

	// Restored, the record is read again; moved aside, the volume is
	// unknown.
	s3, err := openStore(dir)
	must(t, "open", err)
	restored := strings.Replace(string(good), `"v1"`, `"v3"`, 1)
	must(t, "restore", os.WriteFile(p, []byte(restored), 0o600))
	if r, ok, err := s3.lookup("v3"); err != nil || !ok || r.StagingPath != "/s/1" {
		t.Fatalf("lookup of a restored record: %+v, %t, %v", r, ok, err)
	}
	must(t, "damage again", os.WriteFile(p, nil, 0o600))
	s4, err := openStore(dir)
	must(t, "open", err)
	must(t, "move aside", os.Rename(p, p+".damaged"))
	if _, ok, err := s4.lookup("v3"); err != nil || ok {
		t.Fatalf("lookup of a record moved aside: %t, %v", ok, err)
	}
	if len(s4.damagedFiles()) != 0 {
		t.Fatalf("damaged after the file was moved aside: %v", s4.damagedFiles())
	}
}

// A stage that formats writes four records, each with two fsyncs: the
// intent before the attach, the formatting mark, the filesystem's mark
// and the finished stage.
func TestStageIntentSync(t *testing.T) {
	a, _, _ := newFakeAgent(t)
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
	if n := syncs.Load(); n != 8 {
		t.Errorf("%d fsyncs in a stage that formats, want 8", n)
	}
	s, err := openStore(a.state.dir)
	must(t, "reopen", err)
	if r, ok := s.get("v1"); !ok || !r.Staged || r.Formatting != nil {
		t.Errorf("record on reopen %+v %t", r, ok)
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
