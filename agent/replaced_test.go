package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// replacedFixture stages fake volume "7" (ext4) and publishes it.
func replacedFixture(t *testing.T) (*Agent, *fakeFS, *fakeTransport, *nodeServer, *csi.NodeStageVolumeRequest, *csi.NodePublishVolumeRequest) {
	t.Helper()
	a, host, tr := newFakeAgent(t)
	ns := &nodeServer{a: a}
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	stage := &csi.NodeStageVolumeRequest{VolumeId: "v1", StagingTargetPath: staging,
		VolumeContext: map[string]string{"transport": "fake", "fake": "7"}, VolumeCapability: mountCap("ext4", snw)}
	if _, err := ns.NodeStageVolume(context.Background(), stage); err != nil {
		t.Fatal(err)
	}
	publish := &csi.NodePublishVolumeRequest{VolumeId: "v1", StagingTargetPath: staging, TargetPath: target,
		VolumeContext: stage.VolumeContext, VolumeCapability: stage.VolumeCapability}
	if _, err := ns.NodePublishVolume(context.Background(), publish); err != nil {
		t.Fatal(err)
	}
	return a, host, tr, ns, stage, publish
}

// A LUN replaced behind the number the volume_context names, found
// after the staging mount was lost: the stage refuses the new storage
// instead of formatting and mounting it as the volume.
func TestRestageRefusesReplacedStorage(t *testing.T) {
	_, host, tr, ns, stage, _ := replacedFixture(t)
	host.mu.Lock()
	delete(host.mounts, stage.StagingTargetPath)
	host.content["/dev/fake250-7"] = "" // the new LUN is blank
	host.mu.Unlock()
	tr.mu.Lock()
	tr.replaced["7"] = "other-lun"
	tr.mu.Unlock()
	_, err := ns.NodeStageVolume(context.Background(), stage)
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("stage over replaced storage: %v, want FailedPrecondition", err)
	}
	t.Log(err)
	if c := host.contentOf("/dev/fake250-7"); c != "" {
		t.Errorf("the new storage was formatted (%s)", c)
	}
	if host.mounted(stage.StagingTargetPath) {
		t.Error("the new storage was mounted at the staging path")
	}
}

// A publish binds the staging mount only while its device is the one
// staged: over a device that is gone or replaced the filesystem is dead.
func TestPublishRefusesDeadDevice(t *testing.T) {
	_, host, tr, ns, _, publish := replacedFixture(t)
	tr.mu.Lock()
	tr.replaced["7"] = "other-lun"
	tr.mu.Unlock()
	second := &csi.NodePublishVolumeRequest{VolumeId: "v1", StagingTargetPath: publish.StagingTargetPath,
		TargetPath: filepath.Join(filepath.Dir(publish.TargetPath), "second"), VolumeContext: publish.VolumeContext,
		VolumeCapability: publish.VolumeCapability}
	_, err := ns.NodePublishVolume(context.Background(), second)
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish over a replaced device: %v, want FailedPrecondition", err)
	}
	if host.mounted(second.TargetPath) {
		t.Error("published anyway")
	}
}

// The rescan of an expand is the first to read a replaced LUN's identity:
// the filesystem is then not grown into it.
func TestExpandRefusesStorageChangedByRescan(t *testing.T) {
	_, _, tr, ns, stage, publish := replacedFixture(t)
	tr.mu.Lock()
	tr.grownTo = 2 << 20
	tr.replaceAtExpand = "other-lun"
	tr.mu.Unlock()
	_, err := ns.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{VolumeId: "v1", VolumePath: publish.TargetPath,
		StagingTargetPath: stage.StagingTargetPath, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 20}})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("expand over storage replaced under it: %v, want FailedPrecondition", err)
	}
	t.Log(err)
}
