package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func newController(t *testing.T) *controller {
	return &controller{driver: "berth.csi.io", root: t.TempDir(), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

var mountRWO = []*csi.VolumeCapability{{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}}

func code(err error) codes.Code { return status.Code(err) }

// A volume's life: created as a sparse file of the requested size (rounded
// up to MiB) named in its context, created again idempotently, grown and
// never shrunk, deleted twice.
func TestVolumeLife(t *testing.T) {
	c := newController(t)
	ctx := context.Background()
	req := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountRWO, CapacityRange: &csi.CapacityRange{RequiredBytes: 5<<20 + 1}}
	resp, err := c.CreateVolume(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	v := resp.GetVolume()
	if v.GetCapacityBytes() != 6<<20 || v.GetVolumeContext()["file"] != "pvc-1.img" || v.GetVolumeContext()["transport"] != "file" {
		t.Fatalf("volume %+v", v)
	}
	p := filepath.Join(c.root, "pvc-1.img")
	if fi, err := os.Stat(p); err != nil || fi.Size() != 6<<20 {
		t.Fatalf("image file: %v %v", fi, err)
	}
	if _, err := c.CreateVolume(ctx, req); err != nil {
		t.Fatalf("retry: %v", err)
	}
	req.CapacityRange.RequiredBytes = 7 << 20
	if _, err := c.CreateVolume(ctx, req); code(err) != codes.AlreadyExists {
		t.Fatalf("same name, larger: %v, want AlreadyExists", err)
	}
	ex, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: 8 << 20}})
	if err != nil || ex.GetCapacityBytes() != 8<<20 || !ex.GetNodeExpansionRequired() {
		t.Fatalf("expand: %+v %v", ex, err)
	}
	ex, err = c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
	if err != nil || ex.GetCapacityBytes() != 8<<20 {
		t.Fatalf("expand to less: %+v %v, want the size kept", ex, err)
	}
	for i := 0; i < 2; i++ {
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-1"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatalf("image file after delete: %v", err)
	}
	if _, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: 8 << 20}}); code(err) != codes.NotFound {
		t.Fatalf("expand a deleted volume: %v, want NotFound", err)
	}
}

// Names that could leave the root or that no provisioner sends, multi-node
// access and content sources are refused, and nothing is created.
func TestRefused(t *testing.T) {
	c := newController(t)
	ctx := context.Background()
	for _, name := range []string{"", "../x", "a/b", "X", ".img", "pvc-1\x00"} {
		if _, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: mountRWO}); code(err) != codes.InvalidArgument {
			t.Errorf("name %q: %v, want InvalidArgument", name, err)
		}
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: name}); code(err) != codes.InvalidArgument {
			t.Errorf("delete %q: %v, want InvalidArgument", name, err)
		}
	}
	rwx := []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
	}}
	if _, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-2", VolumeCapabilities: rwx}); code(err) != codes.InvalidArgument {
		t.Errorf("multi-node: %v, want InvalidArgument", err)
	}
	if _, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-3", VolumeCapabilities: mountRWO, CapacityRange: &csi.CapacityRange{RequiredBytes: 3<<20 + 1, LimitBytes: 3<<20 + 2}}); code(err) != codes.OutOfRange {
		t.Errorf("limit below the rounded size: %v, want OutOfRange", err)
	}
	if _, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-4", VolumeCapabilities: mountRWO,
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-1"}}}}); code(err) != codes.InvalidArgument {
		t.Errorf("clone: %v, want InvalidArgument", err)
	}
	if ents, _ := os.ReadDir(c.root); len(ents) != 0 {
		t.Errorf("files created by refused requests: %v", ents)
	}
}
