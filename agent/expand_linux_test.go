package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestExpandOnline(t *testing.T) {
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			h := newHarness(t)
			size := int64(300 * mib)
			v := h.newVol("grow", size, mountCap(fsType, snw))
			must(t, "stage", h.stage(v))
			must(t, "publish", h.publish(v, false))
			before := statTotal(t, h, v)

			// Asking for more than the device holds is OutOfRange.
			_, err := h.node.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{
				VolumeId: v.id, VolumePath: v.target, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size},
			})
			wantCode(t, "expand beyond the image", err, codes.OutOfRange)

			must(t, "grow image", os.Truncate(filepath.Join(h.root, "grow.img"), 2*size))
			if fsType == "ext4" && !hasCapability(t, capSysResource) {
				// The kernel refuses ext4 online resize (EXT4_IOC_RESIZE_FS)
				// without CAP_SYS_RESOURCE, which some container sandboxes
				// drop. Check that berth says so and that the volume stays
				// usable; the xfs case covers a successful online grow.
				_, err := h.node.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{
					VolumeId: v.id, VolumePath: v.target, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size},
				})
				// Permanent until berth gets the capability: not
				// Unavailable, which the kubelet retries forever.
				if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "CAP_SYS_RESOURCE") {
					t.Fatalf("expand without CAP_SYS_RESOURCE: %v, want FailedPrecondition naming the capability", err)
				}
				t.Logf("no CAP_SYS_RESOURCE here; ext4 online resize refused as expected: %v", err)
				must(t, "write after a refused resize", os.WriteFile(filepath.Join(v.target, "still-ok"), []byte("ok"), 0o644))
				must(t, "unpublish", h.unpublish(v))
				must(t, "unstage", h.unstage(v))
				return
			}
			resp, err := twice(t, "NodeExpandVolume", h.node.NodeExpandVolume, &csi.NodeExpandVolumeRequest{
				VolumeId: v.id, VolumePath: v.target, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size},
			})
			must(t, "expand", err)
			if resp.CapacityBytes != 2*size {
				t.Fatalf("expand: capacity %d, want %d", resp.CapacityBytes, 2*size)
			}
			after := statTotal(t, h, v)
			if after < before+size*9/10 {
				t.Fatalf("filesystem size %d after expand, was %d", after, before)
			}
			_, err = h.node.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{
				VolumeId: v.id, VolumePath: v.target, CapacityRange: &csi.CapacityRange{RequiredBytes: size, LimitBytes: size + 1},
			})
			wantCode(t, "expand with a limit below the size", err, codes.OutOfRange)
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
		})
	}
}
