package agent

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// BenchmarkStageUnstage measures NodeStageVolume + NodeUnstageVolume of
// an ext4 image that already holds its filesystem (attach loop, probe,
// fsck, mount; unmount, flush, detach) through the gRPC socket.
func BenchmarkStageUnstage(b *testing.B) {
	h := newHarness(b)
	v := h.newVol("bench", 64*mib, mountCap("ext4", snw))
	ctx := context.Background()
	stage := &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx}
	unstage := &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}
	// The first stage formats; the loop measures the steady state.
	if _, err := h.node.NodeStageVolume(ctx, stage); err != nil {
		b.Fatal(err)
	}
	if _, err := h.node.NodeUnstageVolume(ctx, unstage); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		if _, err := h.node.NodeStageVolume(ctx, stage); err != nil {
			b.Fatal(err)
		}
		if _, err := h.node.NodeUnstageVolume(ctx, unstage); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPublishUnpublish measures a bind-mount publish and unpublish
// of a staged volume: the hot path kubelet calls for every pod start.
func BenchmarkPublishUnpublish(b *testing.B) {
	h := newHarness(b)
	v := h.newVol("bench", 64*mib, mountCap("ext4", snw))
	ctx := context.Background()
	if _, err := h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	})
	pub := &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: filepath.Join(filepath.Dir(v.target), "t"), VolumeCapability: v.cap}
	unpub := &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: pub.TargetPath}
	for b.Loop() {
		if _, err := h.node.NodePublishVolume(ctx, pub); err != nil {
			b.Fatal(err)
		}
		if _, err := h.node.NodeUnpublishVolume(ctx, unpub); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPublishRepeated measures an idempotent repeat of a publish
// that is already in place (state lookup + mount point check).
func BenchmarkPublishRepeated(b *testing.B) {
	h := newHarness(b)
	v := h.newVol("bench", 64*mib, mountCap("ext4", snw))
	ctx := context.Background()
	if _, err := h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx}); err != nil {
		b.Fatal(err)
	}
	pub := &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap}
	if _, err := h.node.NodePublishVolume(ctx, pub); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
		h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	})
	for b.Loop() {
		if _, err := h.node.NodePublishVolume(ctx, pub); err != nil {
			b.Fatal(err)
		}
	}
}
