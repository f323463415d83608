package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/berth-csi/berth/fs"
)

// Backing storage that shrank must never shrink the device under a
// mounted filesystem: expand refuses before the device's size is
// touched, and stats say the volume is abnormal.
func TestExpandNeverShrinks(t *testing.T) {
	for _, access := range []string{"mount", "block"} {
		t.Run(access, func(t *testing.T) {
			h := newHarness(t)
			size := int64(256 * mib)
			c := mountCap("ext4", snw)
			if access == "block" {
				c = blockCap(snw)
			}
			v := h.newVol("shrink", size, c)
			ctx := context.Background()
			must(t, "stage", h.stage(v))
			must(t, "publish", h.publish(v, false))
			dev := loopOf(t, h, "shrink.img")

			must(t, "shrink image", os.Truncate(filepath.Join(h.root, "shrink.img"), size/2))
			st, err := h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
			must(t, "stats", err)
			if !st.GetVolumeCondition().GetAbnormal() {
				t.Errorf("stats after the image shrank below the device: %v; want abnormal", st.GetVolumeCondition())
			}
			_, err = h.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target})
			wantCode(t, "expand after the image shrank", err, codes.FailedPrecondition)
			got, err := fs.BlockDeviceSize(dev)
			must(t, "device size", err)
			if got != size {
				t.Fatalf("device %s holds %d bytes after the refused expand, want %d (untouched)", dev, got, size)
			}
			must(t, "restore image", os.Truncate(filepath.Join(h.root, "shrink.img"), size))
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
		})
	}
}
