package agent

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

// pathTransport wraps the fake transport so its targets report paths.
type pathTransport struct {
	*fakeTransport
	states map[string]int
	err    error
	parses int
}

func (pt *pathTransport) Parse(vc, s map[string]string) (Target, error) {
	pt.parses++
	t, err := pt.fakeTransport.Parse(vc, s)
	if err != nil {
		return nil, err
	}
	return &pathTarget{fakeTarget: t.(*fakeTarget), pt: pt}, nil
}

type pathTarget struct {
	*fakeTarget
	pt *pathTransport
}

func (t *pathTarget) PathStates(context.Context) (map[string]int, error) {
	return maps.Clone(t.pt.states), t.pt.err
}

func TestVolumesReportPathStates(t *testing.T) {
	a, _, ft := newFakeAgent(t)
	pt := &pathTransport{fakeTransport: ft, states: map[string]int{"live": 1, "connecting": 1}}
	a.transports["fake"] = pt
	ns := &nodeServer{a: a}
	ctx := context.Background()
	staging := filepath.Join(t.TempDir(), "v1")
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId:          "v1",
		StagingTargetPath: staging,
		VolumeContext:     map[string]string{"transport": "fake", "fake": "7"},
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
	})
	if err != nil {
		t.Fatalf("stage: %v", err)
	}
	pt.parses = 0
	vs := a.Volumes(ctx)
	if len(vs) != 1 || !maps.Equal(vs[0].Paths, pt.states) {
		t.Fatalf("Volumes: %+v, want paths %v", vs, pt.states)
	}
	if pt.parses != 1 {
		t.Errorf("Volumes parsed the volume's target %d times, want once", pt.parses)
	}

	// A target that cannot tell reports no paths rather than stale ones.
	pt.err = errors.New("sysfs gone")
	if vs := a.Volumes(ctx); len(vs) != 1 || vs[0].Paths != nil {
		t.Fatalf("Volumes after an error: %+v", vs)
	}
}

func TestHoldPath(t *testing.T) {
	dir := t.TempDir()
	must(t, "mkdir", os.Mkdir(filepath.Join(dir, "real"), 0o755))
	must(t, "symlink", os.Symlink(filepath.Join(dir, "real"), filepath.Join(dir, "link")))
	must(t, "symlink", os.Symlink("/etc", filepath.Join(dir, "real", "etc")))
	for _, tc := range []struct {
		p       string
		hold    error // holdPath
		openErr error // open of the name
	}{
		{filepath.Join(dir, "real", "target"), nil, errdefs.ErrNotFound},
		{filepath.Join(dir, "real"), nil, nil},
		{filepath.Join(dir, "link", "target"), errdefs.ErrInvalidArgument, nil},
		{filepath.Join(dir, "real", "etc"), nil, errdefs.ErrInvalidArgument},
		{filepath.Join(dir, "real", "etc", "x"), errdefs.ErrInvalidArgument, nil},
		{filepath.Join(dir, "missing", "target"), errdefs.ErrNotFound, nil},
	} {
		p, err := holdPath("target_path", tc.p)
		if (tc.hold == nil && err != nil) || (tc.hold != nil && !errors.Is(err, tc.hold)) {
			t.Errorf("holdPath(%q) = %v, want %v", tc.p, err, tc.hold)
		}
		if err != nil {
			continue
		}
		h, err := p.open()
		if (tc.openErr == nil && err != nil) || (tc.openErr != nil && !errors.Is(err, tc.openErr)) {
			t.Errorf("open %q = %v, want %v", tc.p, err, tc.openErr)
		}
		if h != nil {
			h.Close()
		}
		p.close()
	}
}
