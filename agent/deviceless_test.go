package agent

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// A record marked staged but without a device (a damaged or hand-edited
// state file: berth records the device before it marks a stage done) is
// answered with an error by every RPC that needs the device, never a
// panic that would take the node's berth down with it.
func TestStagedRecordWithoutDevice(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	ctx := context.Background()
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pod", "vol")
	must(t, "mkdir", mkdirAll(staging))
	must(t, "mkdir", mkdirAll(filepath.Dir(target)))
	req := stageReq("vol-nodev", staging, "7")
	must(t, "put", a.state.put(&volumeRecord{
		Version: stateVersion, VolumeID: req.VolumeId, Transport: "fake", Context: req.VolumeContext, TargetKey: "7",
		AccessType: "mount", FsType: "ext4", Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER.String(),
		StagingPath: staging, Staged: true,
	}))

	pub := &csi.NodePublishVolumeRequest{VolumeId: req.VolumeId, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: req.VolumeCapability, VolumeContext: req.VolumeContext}
	_, err := n.NodePublishVolume(ctx, pub)
	wantCode(t, "publish", err, codes.FailedPrecondition)
	_, err = n.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: req.VolumeId, VolumePath: staging, StagingTargetPath: staging})
	wantCode(t, "expand", err, codes.FailedPrecondition)
	st, err := n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: req.VolumeId, VolumePath: staging})
	t.Logf("stats: %v %v", st.GetVolumeCondition(), err)
	// A repeated stage finds no staging mount and stages again, which
	// records the device: the volume is whole again.
	_, err = n.NodeStageVolume(ctx, req)
	must(t, "stage", err)
	_, err = n.NodePublishVolume(ctx, pub)
	must(t, "publish after the stage", err)
}
