package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
)

// A staging mount lost behind berth's back (an operator's umount, a
// mount namespace gone) must not turn the staging directory, which is on
// the node's root filesystem, into what a pod writes to.
func TestLostStagingMount(t *testing.T) {
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			size := int64(64 * mib)
			if fsType == "xfs" {
				size = 300 * mib
			}
			h := newHarness(t)
			v := h.newVol("lost", size, mountCap(fsType, snw))
			ctx := context.Background()
			must(t, "stage", h.stage(v))
			must(t, "publish", h.publish(v, false))
			must(t, "write", os.WriteFile(filepath.Join(v.target, "before"), []byte("on the volume"), 0o644))
			must(t, "unpublish", h.unpublish(v))

			must(t, "umount behind berth's back", unix.Unmount(v.staging, 0))

			_, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
			})
			wantCode(t, "publish with the staging mount lost", err, codes.FailedPrecondition)
			if _, err := os.Lstat(v.target); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("refused publish left target %s behind: %v", v.target, err)
			}
			_, err = h.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.staging})
			wantCode(t, "expand with the staging mount lost", err, codes.FailedPrecondition)
			st, err := h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.staging})
			must(t, "stats", err)
			if !st.GetVolumeCondition().GetAbnormal() || len(st.GetUsage()) != 0 {
				t.Errorf("stats of a lost staging mount: %v; want abnormal and no usage of the host's filesystem", st)
			}

			// Something else mounted there (a tmpfs, say) is not the
			// volume either.
			must(t, "mount tmpfs on staging", unix.Mount("tmpfs", v.staging, "tmpfs", 0, "size=1m"))
			_, err = h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
			})
			wantCode(t, "publish with a foreign mount at staging", err, codes.FailedPrecondition)
			st, err = h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.staging})
			must(t, "stats", err)
			if !st.GetVolumeCondition().GetAbnormal() {
				t.Errorf("stats with a tmpfs at the staging path: %v; want abnormal", st)
			}
			_, err = h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx})
			wantCode(t, "stage over a foreign mount", err, codes.FailedPrecondition)
			must(t, "umount tmpfs", unix.Unmount(v.staging, 0))

			// A bind of a directory of the volume at the staging path
			// has the volume's device but is not its root.
			other := h.mkdir("other")
			must(t, "mount volume elsewhere", unix.Mount(loopOf(t, h, "lost.img"), other, fsType, 0, ""))
			must(t, "mkdir in volume", os.Mkdir(filepath.Join(other, "sub"), 0o755))
			must(t, "bind sub at staging", unix.Mount(filepath.Join(other, "sub"), v.staging, "", unix.MS_BIND, ""))
			_, err = h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
			})
			wantCode(t, "publish with a subdirectory of the volume at staging", err, codes.FailedPrecondition)
			must(t, "umount bind", unix.Unmount(v.staging, 0))
			must(t, "umount other", unix.Unmount(other, 0))

			// NodeStageVolume re-establishes the mount; then publish
			// shows the volume's data.
			must(t, "restage", h.stage(v))
			must(t, "publish", h.publish(v, false))
			if b, err := os.ReadFile(filepath.Join(v.target, "before")); err != nil || string(b) != "on the volume" {
				t.Fatalf("after restage the target holds %q, %v; want the volume's file", b, err)
			}
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
		})
	}
}

// A recorded publish whose target shows something other than the volume
// (a publish made while the staging mount was lost, or a mount put over
// it) is not answered OK.
func TestRepeatedPublishChecksTarget(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("rep", 64*mib, mountCap("ext4", snw))
	ctx := context.Background()
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	hostDir := h.mkdir("hostdir")
	must(t, "mount over target", unix.Mount(hostDir, v.target, "", unix.MS_BIND, ""))
	_, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
	})
	wantCode(t, "repeated publish over a foreign mount", err, codes.FailedPrecondition)
	must(t, "umount foreign", unix.Unmount(v.target, 0))
	must(t, "repeated publish", h.publish(v, false))
	must(t, "unpublish", h.unpublish(v))
	must(t, "unstage", h.unstage(v))
}

func loopOf(t *testing.T, h *harness, image string) string {
	t.Helper()
	rec, ok := h.recordOf("vol-" + image[:len(image)-len(filepath.Ext(image))])
	if !ok || rec.Device == nil {
		t.Fatalf("no device recorded for %s", image)
	}
	return rec.Device.Path
}
