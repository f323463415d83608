package agent

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// An unstage of a stage whose format never finished drops the mark that
// format wrote: a retried format may have made another filesystem since,
// which no pod was given, and a later stage takes it.
func TestUnstageOfUnfinishedFormatDropsMark(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	ns := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	req := stageReq("v1", staging, "3")
	if _, err := ns.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	mark, err := a.marks.get("v1")
	if err != nil || mark == nil || !mark.Made {
		t.Fatalf("mark after a stage that formats: %+v, %v", mark, err)
	}

	// A stage that crashed after its mark, then a retry whose mkfs made
	// a new filesystem and crashed before it wrote the mark.
	rec, _ := a.state.get("v1")
	rec.Staged, rec.Formatting = false, rec.Device
	must(t, "put", a.state.put(rec))
	host.mu.Lock()
	delete(host.mounts, staging)
	host.uuids[rec.Device.Path] = "uuid-remade"
	host.mu.Unlock()

	if _, err := ns.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "v1", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if mark, err := a.marks.get("v1"); err != nil || mark != nil {
		t.Fatalf("mark after the unstage of an unfinished format: %+v, %v", mark, err)
	}
	if _, err := ns.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatalf("stage of the filesystem the unfinished format made: %v", err)
	}
	if mark, err := a.marks.get("v1"); err != nil || mark == nil || mark.UUID != "uuid-remade" || mark.Made {
		t.Fatalf("mark after the stage: %+v, %v", mark, err)
	}

	// A finished stage's mark outlives its unstage.
	if _, err := ns.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "v1", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if mark, err := a.marks.get("v1"); err != nil || mark == nil {
		t.Fatalf("mark after the unstage of a finished stage: %+v, %v", mark, err)
	}
}
