package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

func TestReadOnlyPublish(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("ro", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "publish ro", h.publish(v, true))
	err := os.WriteFile(filepath.Join(v.target, "x"), []byte("x"), 0o644)
	if !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a read-only publish: %v, want EROFS", err)
	}
	// The same target with another read-only flag is a conflict.
	_, err = h.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx,
	})
	wantCode(t, "republish read-write", err, codes.AlreadyExists)
	must(t, "unpublish", h.unpublish(v))

	// A reader-only access mode is read-only even without the flag.
	v.cap = mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY)
	v.id = "vol-ro-2"
	v.vctx = map[string]string{"file": h.newVol("ro2", 64*mib, v.cap).vctx["file"]}
	v.staging = h.mkdir("staging/ro2")
	must(t, "stage reader-only", h.stage(v))
	must(t, "publish reader-only", h.publish(v, false))
	if err := os.WriteFile(filepath.Join(v.target, "x"), []byte("x"), 0o644); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a SINGLE_NODE_READER_ONLY publish: %v, want EROFS", err)
	}
	must(t, "unpublish", h.unpublish(v))
	must(t, "unstage", h.unstage(v))
	_, err = h.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol-ro", StagingTargetPath: h.mkdir("staging/ro")})
	must(t, "unstage first volume", err)
}
