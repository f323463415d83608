package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/fs"
)

// No Node RPC and no metrics scrape reads the node's mount table: on a
// node with tens of thousands of mounts each read costs tens of
// milliseconds. Reads are counted, not timed.
func TestRPCsReadNoMountTable(t *testing.T) {
	for _, tc := range []struct {
		fsType string
		size   int64
	}{{"ext4", 64 * mib}, {"xfs", 300 * mib}} {
		t.Run(tc.fsType, func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("table", tc.size, mountCap(tc.fsType, snw))
			ctx := context.Background()
			before := fs.MountTableReads()
			must(t, "stage", h.stage(v)) // stage, then the repeated one
			must(t, "publish", h.publish(v, false))
			for _, p := range []string{v.staging, v.target} {
				_, err := h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: p})
				must(t, "stats", err)
			}
			if len(h.agent.Volumes(ctx)) != 1 {
				t.Fatal("scrape: want one volume")
			}
			if tc.fsType == "xfs" {
				must(t, "grow image", os.Truncate(filepath.Join(h.root, "table.img"), 2*tc.size))
				_, err := h.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target})
				must(t, "expand", err)
			}
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
			must(t, "stage again (probe and fsck)", h.stage(v))
			must(t, "unstage", h.unstage(v))
			if n := fs.MountTableReads() - before; n != 0 {
				t.Fatalf("the RPCs read the mount table %d times, want 0", n)
			}
		})
	}
}
