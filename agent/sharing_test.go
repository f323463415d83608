package agent

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// Two target keys that turn out, once attached, to be the same device
// (one LUN under two names the keys cannot tell apart): the second stage
// is refused after the attach, naming the first volume, and its undo does
// not detach what the first volume uses.
func TestStageRefusesDeviceOfAnotherVolume(t *testing.T) {
	a, host, tr := newFakeAgent(t)
	n := &nodeServer{a: a}
	ctx := context.Background()
	dir := t.TempDir()
	stagingA, stagingB := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, d := range []string{stagingA, stagingB} {
		must(t, "mkdir", mkdirAll(d))
	}
	// The fake's device is 250:<number the key starts with>: "7" and
	// "7-other-name" are two names of one device.
	_, err := n.NodeStageVolume(ctx, stageReq("vol-a", stagingA, "7"))
	must(t, "stage vol-a", err)
	_, err = n.NodeStageVolume(ctx, stageReq("vol-b", stagingB, "7-other-name"))
	wantCode(t, "stage of another name of vol-a's device", err, codes.FailedPrecondition)
	if !strings.Contains(err.Error(), `"vol-a"`) {
		t.Fatalf("refusal does not name vol-a: %v", err)
	}
	t.Log(err)
	if n := tr.detached["7-other-name"] + tr.detached["7"]; n != 0 {
		t.Fatalf("the refused stage detached the shared device %d times", n)
	}
	if c := host.mountCount(stagingB); c != 0 {
		t.Fatalf("refused volume mounted %d times", c)
	}
	if _, ok := a.state.get("vol-b"); ok {
		t.Fatal("refused stage left a record")
	}
	// vol-a is untouched and unstages normally.
	_, err = n.NodeStageVolume(ctx, stageReq("vol-a", stagingA, "7"))
	must(t, "repeated stage of vol-a", err)
	_, err = n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol-a", StagingTargetPath: stagingA})
	must(t, "unstage vol-a", err)
	if tr.detached["7"] != 1 {
		t.Fatalf("vol-a detached %d times, want 1", tr.detached["7"])
	}
}

// sameStorage compares two recorded devices by what identifies the
// storage, not by the names it was reached through.
func TestSameStorage(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b deviceRecord
		want bool
	}{
		{"same device number", deviceRecord{Major: 8, Minor: 16}, deviceRecord{Major: 8, Minor: 16}, true},
		{"other device number", deviceRecord{Major: 8, Minor: 16}, deviceRecord{Major: 8, Minor: 32}, false},
		{"one LUN through two sessions", deviceRecord{Major: 8, Minor: 16, Kind: "scsi", WWID: "naa.600140512345"}, deviceRecord{Major: 8, Minor: 32, Kind: "scsi", WWID: "naa.600140512345"}, true},
		{"multipath map of the LUN", deviceRecord{Major: 8, Minor: 16, Kind: "scsi", WWID: "naa.600140512345"}, deviceRecord{Major: 253, Minor: 0, Kind: "dm", WWID: "mpath-3600140512345"}, true},
		{"two LUNs", deviceRecord{Major: 8, Minor: 16, Kind: "scsi", WWID: "naa.600140512345"}, deviceRecord{Major: 8, Minor: 32, Kind: "scsi", WWID: "naa.600140512346"}, false},
		{"number reused after a reboot", deviceRecord{Major: 7, Minor: 0, DiskSeq: 9}, deviceRecord{Major: 7, Minor: 0, DiskSeq: 2}, false},
		{"same medium", deviceRecord{Major: 7, Minor: 0, DiskSeq: 9}, deviceRecord{Major: 7, Minor: 0, DiskSeq: 9}, true},
		{"no record", deviceRecord{}, deviceRecord{Major: 7, Minor: 0}, false},
		{"namespace by two controllers", deviceRecord{Major: 259, Minor: 1, Kind: "nvme", NQN: "nqn.x", NSID: 1}, deviceRecord{Major: 259, Minor: 3, Kind: "nvme", NQN: "nqn.x", NSID: 1}, true},
		{"namespace by uuid", deviceRecord{Major: 259, Minor: 1, Kind: "nvme", NQN: "nqn.x", NSID: 1, UUID: "u1"}, deviceRecord{Major: 259, Minor: 3, Kind: "nvme", NQN: "nqn.x", NSID: 2, UUID: "u1"}, true},
		{"namespace by nguid", deviceRecord{Major: 259, Minor: 1, Kind: "nvme", NQN: "nqn.x", NGUID: "g1"}, deviceRecord{Major: 259, Minor: 3, Kind: "nvme", NQN: "nqn.y", NGUID: "g1"}, true},
		{"two namespaces", deviceRecord{Major: 259, Minor: 1, Kind: "nvme", NQN: "nqn.x", NSID: 1}, deviceRecord{Major: 259, Minor: 3, Kind: "nvme", NQN: "nqn.x", NSID: 2}, false},
		{"same nsid of two subsystems", deviceRecord{Major: 259, Minor: 1, Kind: "nvme", NQN: "nqn.x", NSID: 1}, deviceRecord{Major: 259, Minor: 3, Kind: "nvme", NQN: "nqn.y", NSID: 1}, false},
	} {
		if got := sameStorage(&tc.a, &tc.b); got != tc.want {
			t.Errorf("%s: sameStorage = %v, want %v", tc.name, got, tc.want)
		}
		if got := sameStorage(&tc.b, &tc.a); got != tc.want {
			t.Errorf("%s (swapped): sameStorage = %v, want %v", tc.name, got, tc.want)
		}
	}
}
