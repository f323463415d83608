package agent

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

// v010Record is a record as v0.1.0 wrote it (indented, format 1): a
// mounted file volume published at one target.
const v010Record = `{
  "version": 1,
  "volumeID": "v1",
  "transport": "file",
  "context": {
    "file": "vol.img"
  },
  "targetKey": "file:vol.img",
  "targetID": "file:2049:131",
  "accessType": "mount",
  "fsType": "ext4",
  "mode": "SINGLE_NODE_WRITER",
  "stagingPath": "/s/1",
  "stagingRootIno": 2,
  "staged": true,
  "device": {
    "name": "loop7",
    "path": "/dev/loop7",
    "major": 7,
    "minor": 7,
    "size": 67108864,
    "diskSeq": 12,
    "kind": "loop",
    "backingFile": "/images/vol.img"
  },
  "publishes": {
    "/t/1": {
      "readOnly": false,
      "mode": "SINGLE_NODE_WRITER"
    }
  }
}`

// A format 1 record (v0.1.0's, or one without a version) is read as
// v0.1.0 meant it: its publish targets are berth's to remove, its loop
// device has no backing file numbers. Written again, it is in today's
// format.
func TestStateFormat1Read(t *testing.T) {
	for _, tc := range []struct{ name, b string }{
		{"v0.1.0", v010Record},
		{"no version", strings.Replace(v010Record, `"version": 1,`, "", 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "volumes")
			must(t, "mkdir", os.MkdirAll(dir, 0o700))
			p := filepath.Join(dir, stateFileName("v1"))
			must(t, "write", os.WriteFile(p, []byte(tc.b), 0o600))
			s, err := openStore(dir)
			must(t, "openStore", err)
			r, ok, err := s.lookup("v1")
			if err != nil || !ok {
				t.Fatalf("lookup: %t, %v", ok, err)
			}
			if r.Version != 1 || !r.Staged || r.Device.Name != "loop7" || r.Device.loopRef() != nil || r.Crypt != nil {
				t.Fatalf("record read as %+v, device %+v", r, r.Device)
			}
			if pub, ok := r.Publishes["/t/1"]; !ok || !pub.TargetMade {
				t.Fatalf("v0.1.0's publish: %+v, %t; want its target removed at unpublish as v0.1.0 did", pub, ok)
			}
			if b, _ := os.ReadFile(p); string(b) != tc.b {
				t.Fatalf("reading rewrote the record: %s", b)
			}
			must(t, "put", s.put(r))
			s2, err := openStore(dir)
			must(t, "reopen", err)
			r2, _ := s2.get("v1")
			if r2.Version != stateVersion || !r2.Publishes["/t/1"].TargetMade {
				t.Fatalf("rewritten record: %+v", r2)
			}
		})
	}
}

// A record in a newer format is kept byte for byte, named at open, and
// its volume's calls are refused with both formats named; the other
// volumes carry on.
func TestStateNewerFormatRefused(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "volumes")
	s, err := openStore(dir)
	must(t, "openStore", err)
	must(t, "put", s.put(&volumeRecord{VolumeID: "v1", Transport: "file", StagingPath: "/s/1"}))
	p := filepath.Join(dir, stateFileName("v2"))
	newer := []byte(`{"version":3,"volumeID":"v2","transport":"file","staged":true,"publishes":"a newer shape"}`)
	must(t, "write newer", os.WriteFile(p, newer, 0o600))

	s, err = openStore(dir)
	must(t, "reopen", err)
	var nf *newerFormatError
	if why, ok := s.damagedFiles()[p]; !ok || !errors.As(why, &nf) || nf.version != 3 || s.count() != 2 {
		t.Fatalf("newer record at open: %v, count %d", s.damagedFiles(), s.count())
	}
	_, _, err = s.lookup("v2")
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "format 3") ||
		!strings.Contains(err.Error(), "format 2") || !strings.Contains(err.Error(), p) {
		t.Fatalf("lookup of the newer record's volume: %v", err)
	}
	if _, ok, err := s.lookup("v1"); !ok || err != nil {
		t.Fatalf("lookup of another volume: %t, %v", ok, err)
	}
	if b, err := os.ReadFile(p); err != nil || !bytes.Equal(b, newer) {
		t.Fatalf("newer record not kept: %q, %v", b, err)
	}
	if r, _ := s.get("v1"); r.Version != stateVersion {
		t.Fatalf("today's record in format %d", r.Version)
	}
	for _, v := range []string{`0`, `-1`, `"2"`} {
		must(t, "write", os.WriteFile(p, []byte(`{"version":`+v+`,"volumeID":"v2"}`), 0o600))
		if _, _, err := s.lookup("v2"); !errors.Is(err, errdefs.ErrFailedPrecondition) || errors.As(err, &nf) {
			t.Fatalf("lookup of a record of version %s: %v", v, err)
		}
	}
}

// A filesystem mark in a newer format refuses the stage (which might
// otherwise format) and is neither rewritten nor removed; one without a
// version is format 1.
func TestFSMarkFormats(t *testing.T) {
	m, err := openFSMarks(filepath.Join(t.TempDir(), "filesystems"))
	must(t, "openFSMarks", err)
	must(t, "put", m.put(&fsMark{VolumeID: "v1", FsType: "ext4", UUID: "u"}))
	if mk, err := m.get("v1"); err != nil || mk.Version != stateVersion {
		t.Fatalf("today's mark: %+v, %v", mk, err)
	}
	must(t, "write format 1", os.WriteFile(m.path("v1"), []byte(`{"volumeID":"v1","fsType":"ext4","uuid":"u","made":true}`), 0o600))
	if mk, err := m.get("v1"); err != nil || mk.Version != 1 || !mk.Made || mk.UUID != "u" {
		t.Fatalf("format 1 mark: %+v, %v", mk, err)
	}
	newer := []byte(`{"version":3,"volumeID":"v1","uuid":{"a":"newer shape"}}`)
	must(t, "write newer", os.WriteFile(m.path("v1"), newer, 0o600))
	for what, err := range map[string]error{"get": func() error { _, err := m.get("v1"); return err }(), "remove": m.remove("v1")} {
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "format 3") || !strings.Contains(err.Error(), "format 2") {
			t.Fatalf("%s of a newer mark: %v", what, err)
		}
	}
	if b, err := os.ReadFile(m.path("v1")); err != nil || !bytes.Equal(b, newer) {
		t.Fatalf("newer mark not kept: %q, %v", b, err)
	}
}
