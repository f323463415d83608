package agent

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/forklock/forklocktest"
)

// TestLifecycleWhileForking stages, publishes, unpublishes and unstages
// one volume over and over while children are started without pause, as
// the other volumes' mkfs and blkid are on a busy node. A child holds a
// copy of every descriptor from its start to its exec: one of a mount
// that berth looked at (the new bind a publish checks, the staging mount
// it binds from) must not make the unpublish or unstage that follows
// fail as busy.
func TestLifecycleWhileForking(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("data", 64*mib, mountCap("ext4", snw))
	forklocktest.Fork(t)
	ctx := context.Background()
	t.Cleanup(func() {
		h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
		h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	})
	for i := range 150 {
		if _, err := h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
			VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx,
		}); err != nil {
			t.Fatalf("stage %d while forking: %v", i, err)
		}
		if _, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
		}); err != nil {
			t.Fatalf("publish %d while forking: %v", i, err)
		}
		if _, err := h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
			t.Fatalf("unpublish %d while forking: %v", i, err)
		}
		if _, err := h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
			t.Fatalf("unstage %d while forking: %v", i, err)
		}
	}
}
