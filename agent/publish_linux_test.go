package agent

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

// Publish and unpublish never destroy what berth did not make: a raw
// block publish onto a regular file with content is refused, and a
// target that was there before the publish stays after the unpublish.
func TestPublishLeavesForeignTarget(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("blk", 64*mib, blockCap(snw))
	must(t, "stage", h.stage(v))
	precious := []byte("not berth's\n")
	must(t, "write target", os.WriteFile(v.target, precious, 0o600))
	err := h.publish(v, false)
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("raw block publish onto a file with content: %v (%v), want FailedPrecondition", status.Code(err), err)
		if err == nil {
			must(t, "unpublish", h.unpublish(v))
		}
	}
	if b, err := os.ReadFile(v.target); err != nil || !bytes.Equal(b, precious) {
		t.Fatalf("the file at the target after publish and unpublish: %q, %v; want %q", b, err, precious)
	}

	// An empty file the CO made: published, and left after the unpublish.
	must(t, "empty target", os.WriteFile(v.target, nil, 0o600))
	must(t, "publish onto an empty file", h.publish(v, false))
	must(t, "unpublish", h.unpublish(v))
	if _, err := os.Lstat(v.target); err != nil {
		t.Errorf("the CO's empty target file is gone after the unpublish: %v", err)
	}
	must(t, "unstage", h.unstage(v))

	m := h.newVol("dir", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(m))
	must(t, "target directory", os.Mkdir(m.target, 0o750))
	must(t, "publish onto an empty directory", h.publish(m, false))
	must(t, "unpublish", h.unpublish(m))
	if fi, err := os.Lstat(m.target); err != nil || !fi.IsDir() {
		t.Errorf("the CO's target directory is gone after the unpublish: %v", err)
	}
	must(t, "unstage", h.unstage(m))
}

// An unpublish whose target lies on a filesystem that turned read-only
// unmounts the publish and answers OK, also when retried, although the
// target cannot be removed.
func TestUnpublishOnReadOnlyParent(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("data", 64*mib, mountCap("ext4", snw))
	parent := filepath.Dir(v.target)
	must(t, "mount tmpfs", syscall.Mount("tmpfs", parent, "tmpfs", 0, "size=1m"))
	t.Cleanup(func() {
		if err := syscall.Unmount(parent, 0); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	must(t, "remount read-only", syscall.Mount("", parent, "", syscall.MS_REMOUNT|syscall.MS_BIND|syscall.MS_RDONLY, ""))
	err := h.unpublish(v)
	if err != nil {
		t.Errorf("unpublish with the target's filesystem read-only: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(v.target, "lost+found")); err == nil {
		t.Errorf("the volume is still mounted at the target")
	}
	must(t, "remount read-write", syscall.Mount("", parent, "", syscall.MS_REMOUNT|syscall.MS_BIND, ""))
	if err != nil {
		must(t, "unpublish once writable", h.unpublish(v))
	}
	must(t, "unstage", h.unstage(v))
}

// A file volume's image name with a component longer than NAME_MAX is
// an invalid request, not an internal error.
func TestStageImageNameTooLong(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("data", 64*mib, mountCap("ext4", snw))
	for _, name := range []string{strings.Repeat("a", 256) + ".img", "dir/" + strings.Repeat("b", 300)} {
		v.vctx = map[string]string{"file": name}
		wantCode(t, "stage of "+name[:20]+"...", h.stage(v), codes.InvalidArgument)
	}
}
