package iscsi

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

// sampleSys is the saved tree testdata/sysfs.txt: two sessions of
// testIQN, the first with two LUNs.
func sampleSys(t *testing.T) sysTree {
	t.Helper()
	sys := sysfstest.New(t)
	sys.Load(filepath.Join("testdata", "sysfs.txt"))
	return sysTree{root: sys.Root()}
}

func TestSysfsSessions(t *testing.T) {
	s := sampleSys(t)
	got, err := s.Sessions("")
	if err != nil {
		t.Fatal(err)
	}
	want := []Session{
		{ID: 1, Target: testIQN, TPGT: 1, Iface: "default", State: "LOGGED_IN", Host: 2, TargetID: 0,
			PersistentAddress: "10.0.0.1", PersistentPort: 3260, Address: "10.0.0.1", Port: 3260},
		{ID: 2, Target: testIQN, TPGT: 2, Iface: "default", State: "FAILED", Host: 3, TargetID: -1,
			PersistentAddress: "fd00::1", PersistentPort: 3260, Address: "fd00::2", Port: 3261},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
	if !got[0].Matches(testIQN, "10.0.0.1", 3260, "default") || got[0].Matches(testIQN, "10.0.0.1", 3261, "default") ||
		got[0].Matches(testIQN, "10.0.0.1", 3260, "iface1") || got[0].Matches(testIQN+"x", "10.0.0.1", 3260, "default") {
		t.Fatal("Matches on session1 wrong")
	}
	// Persistent (what iscsiadm logged in to, written out in full) and
	// current (after a redirect) addresses both match.
	if !got[1].Matches(testIQN, "fd00::1", 3260, "default") || !got[1].Matches(testIQN, "fd00:0::2", 3261, "default") {
		t.Fatal("Matches on session2 wrong")
	}
	if _, err := s.Session(9); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing session: %v", err)
	}
	if of, err := s.Sessions(testIQN); err != nil || !reflect.DeepEqual(of, want) {
		t.Fatalf("Sessions(%q) = %+v, %v; want both", testIQN, of, err)
	}
	if of, err := s.Sessions(testIQN + "x"); err != nil || len(of) != 0 {
		t.Fatalf("Sessions of another target = %+v, %v; want none", of, err)
	}
}

func TestSysfsLUNs(t *testing.T) {
	s := sampleSys(t)
	luns, err := s.LUNs(1)
	if err != nil {
		t.Fatal(err)
	}
	if want := []HCTL{{2, 0, 0, 0}, {2, 0, 0, 1}}; !reflect.DeepEqual(luns, want) {
		t.Fatalf("got %v want %v", luns, want)
	}
	if luns, err := s.LUNs(2); err != nil || len(luns) != 0 {
		t.Fatalf("session2: %v %v", luns, err)
	}
	if name, err := s.BlockDevice(HCTL{2, 0, 0, 1}); err != nil || name != "sdb" {
		t.Fatalf("block device: %q %v", name, err)
	}
	if _, err := s.BlockDevice(HCTL{2, 0, 0, 7}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing LUN: %v", err)
	}
	if st := s.SCSIDeviceState(HCTL{2, 0, 0, 0}); st != "running" {
		t.Fatal(st)
	}
}

func TestSysfsScan(t *testing.T) {
	s := sampleSys(t)
	sess, err := s.Session(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Scan(sess, 5); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(s.root.Path("class", "scsi_host", "host2", "scan"))
	if string(b) != "0 0 5" {
		t.Fatalf("scan wrote %q, want only LUN 5 of target 0", b)
	}
	// Without target_id the target is a wildcard on the session's own host.
	sess2, _ := s.Session(2)
	if err := s.Scan(sess2, 3); err != nil {
		t.Fatal(err)
	}
	b, _ = os.ReadFile(s.root.Path("class", "scsi_host", "host3", "scan"))
	if string(b) != "0 - 3" {
		t.Fatalf("scan wrote %q", b)
	}
}

func TestParseHCTL(t *testing.T) {
	if h, ok := parseHCTL("3:0:1:16383"); !ok || h != (HCTL{3, 0, 1, 16383}) || h.String() != "3:0:1:16383" {
		t.Fatal(h, ok)
	}
	for _, bad := range []string{"3:0:1", "a:0:0:0", "target3:0:0", "1:2:3:4:5"} {
		if _, ok := parseHCTL(bad); ok {
			t.Errorf("%q parsed", bad)
		}
	}
}
