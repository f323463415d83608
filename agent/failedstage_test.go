package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// failingTransport's targets fail Attach before touching anything and
// fail Detach as a node without the transport's tools does.
type failingTransport struct{ *fakeTransport }

func (ft failingTransport) Parse(vc, s map[string]string) (Target, error) {
	t, err := ft.fakeTransport.Parse(vc, s)
	if err != nil {
		return nil, err
	}
	return failingTarget{t.(*fakeTarget)}, nil
}

type failingTarget struct{ *fakeTarget }

func (failingTarget) Attach(context.Context) (*devices.Device, error) {
	return nil, errors.Join(errors.New("the iscsi_tcp kernel module is not loaded"), errdefs.ErrUnavailable)
}

func (failingTarget) Detach(context.Context, *devices.Recorded) error {
	return errors.New(`exec: "iscsiadm": executable file not found in $PATH`)
}

func (failingTarget) Preflight(context.Context) error {
	return errors.Join(errors.New("the iscsi_tcp kernel module is not loaded"), errdefs.ErrUnavailable)
}

// A stage that fails because the node cannot attach the target (a kernel
// module or a tool missing) leaves no record: nothing blocks the staging
// path, and NodeUnstageVolume answers OK whatever else the node lacks.
func TestFailedPreflightLeavesNothing(t *testing.T) {
	a, _, ft := newFakeAgent(t)
	a.transports["fake"] = failingTransport{ft}
	ns := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "v1")
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	req := &csi.NodeStageVolumeRequest{
		VolumeId: "v1", StagingTargetPath: staging,
		VolumeContext:    map[string]string{"transport": "fake", "fake": "7"},
		VolumeCapability: mountCap("ext4", snw),
	}
	if _, err := ns.NodeStageVolume(context.Background(), req); status.Code(err) != codes.Unavailable {
		t.Fatalf("stage: %v, want Unavailable", err)
	}
	if _, ok := a.state.get("v1"); ok {
		t.Fatal("a stage refused before attaching left a record")
	}
	// Another volume may use the staging path.
	a.transports["fake"] = ft
	req2 := &csi.NodeStageVolumeRequest{
		VolumeId: "v2", StagingTargetPath: staging,
		VolumeContext:    map[string]string{"transport": "fake", "fake": "8"},
		VolumeCapability: mountCap("ext4", snw),
	}
	if _, err := ns.NodeStageVolume(context.Background(), req2); err != nil {
		t.Fatalf("stage of another volume at the path: %v", err)
	}
	// The transport switched off, its tools missing: nothing of v1 was
	// attached, so nothing needs them.
	delete(a.transports, "fake")
	if _, err := ns.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "v1", StagingTargetPath: staging}); err != nil {
		t.Fatalf("unstage of a volume that never attached: %v", err)
	}
}

// A repeated stage of a volume whose device is gone (an NVMe controller
// lost after ctrl_loss_tmo, a LUN removed) does not answer OK on the dead
// filesystem still mounted at the staging path.
func TestRepeatedStageChecksDeviceAlive(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	ns := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "v1")
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	req := &csi.NodeStageVolumeRequest{
		VolumeId: "v1", StagingTargetPath: staging,
		VolumeContext:    map[string]string{"transport": "fake", "fake": "7"},
		VolumeCapability: mountCap("ext4", snw),
	}
	if _, err := ns.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if _, err := ns.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatalf("repeated stage: %v", err)
	}
	a.lookup = func(string) (*devices.Device, error) { return nil, os.ErrNotExist }
	_, err := ns.NodeStageVolume(context.Background(), req)
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("repeated stage with the device gone: %v, want FailedPrecondition", err)
	}
}
