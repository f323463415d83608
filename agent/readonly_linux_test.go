package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// wantDeviceRO checks the block layer's read-only flag of a device.
func wantDeviceRO(t *testing.T, what, dev string, want bool) {
	t.Helper()
	ro, err := fs.DeviceReadOnly(dev)
	must(t, what+": BLKROGET", err)
	if ro != want {
		t.Fatalf("%s: device %s read-only=%t, want %t", what, dev, ro, want)
	}
}

// writeRefused checks that a write through p, opened for writing the way
// a pod would, is refused by the kernel.
func writeRefused(t *testing.T, what, p string, b []byte) {
	t.Helper()
	denied := func(err error) bool {
		return errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EROFS)
	}
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		if !denied(err) {
			t.Fatalf("%s: open for writing: %v, want EPERM, EACCES or EROFS", what, err)
		}
		return
	}
	defer f.Close()
	_, err = f.WriteAt(b, 8*mib)
	if err == nil {
		err = f.Sync()
	}
	if !denied(err) {
		t.Fatalf("%s: write through a read-only publish: %v, want EPERM, EACCES or EROFS", what, err)
	}
}

func writeBlock(t *testing.T, what, p string, b []byte) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	must(t, what+": open", err)
	defer f.Close()
	_, err = f.WriteAt(b, 8*mib)
	must(t, what+": write", err)
	must(t, what+": fsync", f.Sync())
}

// readBoth returns the bytes at 8 MiB as the device and as its backing
// image hold them.
func readBoth(t *testing.T, dev, img string, n int) (viaDev, viaImg []byte) {
	t.Helper()
	viaDev, viaImg = make([]byte, n), make([]byte, n)
	for _, x := range []struct {
		p   string
		buf []byte
	}{{dev, viaDev}, {img, viaImg}} {
		f, err := os.Open(x.p)
		must(t, "open "+x.p, err)
		_, err = f.ReadAt(x.buf, 8*mib)
		f.Close()
		must(t, "read "+x.p, err)
	}
	return viaDev, viaImg
}

// A read-only raw block publish is read-only at the block layer, since a
// read-only bind mount of a device node does not stop writes through it.
func TestReadOnlyBlockPublish(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("rawro", 16*mib, blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER))
	v.target = filepath.Join(filepath.Dir(v.target), "dev-ro")
	img := filepath.Join(h.root, "rawro.img")
	must(t, "stage", h.stage(v))
	loop, err := devices.Roots{}.FindLoop(img)
	must(t, "find loop", err)
	// A failed run must not hand a read-only loop device to the next.
	t.Cleanup(func() { _ = fs.SetDeviceReadOnly(loop.Path, false) })
	wantDeviceRO(t, "after stage", loop.Path, false)

	pattern := bytes.Repeat([]byte("berth-ro!"), 4096/9+1)[:4096]
	zero := make([]byte, len(pattern))
	must(t, "publish ro", h.publish(v, true))
	wantDeviceRO(t, "read-only publish", loop.Path, true)
	writeRefused(t, "read-only publish", v.target, pattern)
	if d, i := readBoth(t, v.target, img, len(pattern)); !bytes.Equal(d, zero) || !bytes.Equal(i, zero) {
		t.Fatal("device bytes changed through a read-only publish")
	}

	// The block layer has one read-only flag per device: a read-write
	// publish beside a read-only one would make both writable, and is
	// refused; so is a read-only one beside a read-write one.
	rw := v
	rw.target = filepath.Join(filepath.Dir(v.target), "dev-rw")
	_, err = h.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: rw.id, StagingTargetPath: rw.staging, TargetPath: rw.target, VolumeCapability: rw.cap, VolumeContext: rw.vctx,
	})
	wantCode(t, "read-write publish beside a read-only one", err, codes.FailedPrecondition)
	wantDeviceRO(t, "after the refused read-write publish", loop.Path, true)
	writeRefused(t, "read-only publish beside the refused one", v.target, pattern)
	if _, err := os.Lstat(rw.target); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("refused publish left %s: %v", rw.target, err)
	}
	must(t, "unpublish ro", h.unpublish(v))
	wantDeviceRO(t, "no publish", loop.Path, false)
	must(t, "publish rw", h.publish(rw, false))
	writeBlock(t, "read-write publish", rw.target, pattern)
	if d, i := readBoth(t, rw.target, img, len(pattern)); !bytes.Equal(d, pattern) || !bytes.Equal(i, pattern) {
		t.Fatal("bytes written through the read-write publish are not on the device")
	}
	_, err = h.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx, Readonly: true,
	})
	wantCode(t, "read-only publish beside a read-write one", err, codes.FailedPrecondition)
	wantDeviceRO(t, "after the refused read-only publish", loop.Path, false)
	must(t, "unpublish rw", h.unpublish(rw))

	// What berth set survives a restart and is undone after it.
	must(t, "publish ro again", h.publish(v, true))
	if rec, _ := h.recordOf(v.id); !rec.DeviceReadOnly {
		t.Fatal("state does not record that berth made the device read-only")
	}
	h.stop()
	h.start()
	must(t, "publish ro after restart", h.publish(v, true))
	wantDeviceRO(t, "after restart", loop.Path, true)
	must(t, "unpublish after restart", h.unpublish(v))
	wantDeviceRO(t, "unpublished after restart", loop.Path, false)
	if rec, _ := h.recordOf(v.id); rec.DeviceReadOnly {
		t.Fatal("state still records a read-only device after the last unpublish")
	}

	// A publish whose mount vanished (a node reboot, say) is dropped at
	// unstage, which clears the flag before the device is detached.
	must(t, "publish ro for unstage", h.publish(v, true))
	must(t, "unmount by hand", syscall.Unmount(v.target, 0))
	must(t, "unstage", h.unstage(v))
	wantDeviceRO(t, "after unstage", loop.Path, false)
}

// A reader-only access mode makes the device read-only from the first
// publish on, even when the publish does not ask for read-only.
func TestReaderOnlyModeBlock(t *testing.T) {
	for _, mode := range []csi.VolumeCapability_AccessMode_Mode{
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
	} {
		t.Run(mode.String(), func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("reader", 16*mib, blockCap(mode))
			v.target = filepath.Join(filepath.Dir(v.target), "dev")
			img := filepath.Join(h.root, "reader.img")
			must(t, "stage", h.stage(v))
			loop, err := devices.Roots{}.FindLoop(img)
			must(t, "find loop", err)
			t.Cleanup(func() { _ = fs.SetDeviceReadOnly(loop.Path, false) })
			wantDeviceRO(t, "after stage", loop.Path, false)
			must(t, "publish", h.publish(v, false))
			wantDeviceRO(t, "publish", loop.Path, true)
			pattern := bytes.Repeat([]byte{0x5a}, 4096)
			writeRefused(t, "reader-only publish", v.target, pattern)
			if d, i := readBoth(t, v.target, img, len(pattern)); !bytes.Equal(d, make([]byte, len(pattern))) || !bytes.Equal(i, make([]byte, len(pattern))) {
				t.Fatal("device bytes changed through a reader-only publish")
			}
			must(t, "unpublish", h.unpublish(v))
			wantDeviceRO(t, "unpublished", loop.Path, false)
			must(t, "unstage", h.unstage(v))
		})
	}
}

// A read-only raw block publish whose device cannot be made read-only
// fails, leaves nothing published, and a read-write one still works.
func TestReadOnlyBlockPublishFailsClosed(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	ctx := context.Background()
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "dev")
	must(t, "mkdir", mkdirAll(staging))
	c := blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	vctx := map[string]string{"transport": "fake", "fake": "7"}
	_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: c, VolumeContext: vctx})
	must(t, "stage", err)
	host.roErr = fmt.Errorf("ioctl BLKROSET: %w: %w", syscall.EPERM, errdefs.ErrPermissionDenied)
	pub := &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, VolumeContext: vctx, Readonly: true}
	_, err = n.NodePublishVolume(ctx, pub)
	wantCode(t, "read-only publish without BLKROSET", err, codes.PermissionDenied)
	if host.mounted(target) {
		t.Fatal("a read-only publish that could not protect the device was mounted")
	}
	if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("target left behind: %v", err)
	}
	rec, _ := a.state.get("v")
	if len(rec.Publishes) != 0 {
		t.Fatalf("publish recorded after failing: %v", rec.Publishes)
	}
	pub.Readonly = false
	_, err = n.NodePublishVolume(ctx, pub)
	must(t, "read-write publish", err)
	if host.ro["/dev/fake250-7"] {
		t.Fatal("device read-only after a read-write publish")
	}
}
