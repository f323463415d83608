package agent

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
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

// BenchmarkFirstStage measures NodeStageVolume of a blank ext4 image of
// 256 MiB and 1 GiB (attach loop, probe, mkfs, mount) through the gRPC
// socket, and the raw steps it is compared with (losetup, mkfs.ext4 with
// berth's options, mount(2)). Undoing a round and a fresh image for the
// next are not timed.
func BenchmarkFirstStage(b *testing.B) {
	for _, size := range []int64{256 * mib, 1024 * mib} {
		b.Run(fmt.Sprintf("%dMiB/berth", size/mib), func(b *testing.B) {
			h := newHarness(b)
			v := h.newVol("first", size, mountCap("ext4", snw))
			ctx := context.Background()
			img := filepath.Join(h.root, "first.img")
			for i := range b.N {
				// Each round's image is a new volume, with an ID of its
				// own: berth never formats again a volume ID it formatted.
				id := fmt.Sprintf("%s-%d", v.id, i)
				stage := &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx}
				unstage := &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: v.staging}
				if _, err := h.node.NodeStageVolume(ctx, stage); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if _, err := h.node.NodeUnstageVolume(ctx, unstage); err != nil {
					b.Fatal(err)
				}
				if err := os.Remove(img); err != nil {
					b.Fatal(err)
				}
				h.image("first.img", size)
				b.StartTimer()
			}
		})
		b.Run(fmt.Sprintf("%dMiB/raw", size/mib), func(b *testing.B) {
			h := newHarness(b)
			h.image("raw.img", size)
			img, mnt := filepath.Join(h.root, "raw.img"), h.mkdir("raw-mnt")
			run := func(name string, args ...string) string {
				out, err := exec.Command(name, args...).CombinedOutput()
				if err != nil {
					b.Fatalf("%s %v: %v: %s", name, args, err, out)
				}
				return strings.TrimSpace(string(out))
			}
			for range b.N {
				dev := run("losetup", "--find", "--show", "--", img)
				run("mkfs.ext4", "-q", "-t", "ext4", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "--", dev)
				if err := syscall.Mount(dev, mnt, "ext4", 0, ""); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := syscall.Unmount(mnt, 0); err != nil {
					b.Fatal(err)
				}
				run("losetup", "--detach", dev)
				if err := os.Remove(img); err != nil {
					b.Fatal(err)
				}
				h.image("raw.img", size)
				b.StartTimer()
			}
		})
	}
}
