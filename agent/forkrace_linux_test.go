package agent

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/forklock/forklocktest"
)

// TestPublishUnpublishWhileForking publishes and unpublishes one volume
// over and over while children are started without pause, as the other
// volumes' mkfs and blkid do on a busy node. A child holds a copy of
// every descriptor from its start to its exec: one of a mount that
// berth opened to look at it would keep the unmount that follows busy.
func TestPublishUnpublishWhileForking(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("data", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	forklocktest.Fork(t)
	t.Cleanup(func() {
		ctx := context.Background()
		h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
		h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	})
	ctx := context.Background()
	for i := range 1000 {
		if _, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
		}); err != nil {
			t.Fatalf("publish %d while forking: %v", i, err)
		}
		if _, err := h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
			t.Fatalf("unpublish %d while forking: %v", i, err)
		}
	}
	must(t, "unstage", h.unstage(v))
}

// TestLifecycleWhileForking stages, publishes, unpublishes and unstages
// one volume over and over while children are started without pause:
// the descriptors of the staging mount that a publish holds (the source
// of its bind) must not keep the unstage's unmount busy either.
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
