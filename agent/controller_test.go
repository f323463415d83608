package agent

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// startController serves a Controller on a socket in a temporary
// directory and returns a connection to it and the controller's log.
func startController(t *testing.T) (*grpc.ClientConn, *bytes.Buffer) {
	t.Helper()
	var logs bytes.Buffer
	c, err := NewController(ControllerConfig{Version: "v9", Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	must(t, "NewController", err)
	endpoint := "unix://" + filepath.Join(t.TempDir(), "controller.sock")
	lis, err := Listen(endpoint)
	must(t, "Listen", err)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- c.Serve(ctx, lis) }()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, "dial", err)
	t.Cleanup(func() {
		conn.Close()
		cancel()
		select {
		case err := <-served:
			must(t, "Serve", err)
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return after its context ended")
		}
	})
	return conn, &logs
}

func publishReq() *csi.ControllerPublishVolumeRequest {
	return &csi.ControllerPublishVolumeRequest{
		VolumeId: "vol-1",
		NodeId:   "node-b",
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
		VolumeContext: map[string]string{"transport": "file", "file": "vol-1.img"},
		Secrets:       map[string]string{"password": "hunter2-secret"},
	}
}

// The external-attacher's view: a controller service whose only
// capability is PUBLISH_UNPUBLISH_VOLUME, under the node plugin's name.
func TestControllerIdentityAndCapabilities(t *testing.T) {
	conn, _ := startController(t)
	ctx := context.Background()
	id := csi.NewIdentityClient(conn)
	info, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	must(t, "GetPluginInfo", err)
	if info.GetName() != DefaultDriverName || info.GetVendorVersion() != "v9" {
		t.Errorf("GetPluginInfo = %v", info)
	}
	pc, err := id.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	must(t, "GetPluginCapabilities", err)
	if len(pc.GetCapabilities()) != 1 || pc.GetCapabilities()[0].GetService().GetType() != csi.PluginCapability_Service_CONTROLLER_SERVICE {
		t.Errorf("plugin capabilities = %v, want CONTROLLER_SERVICE only", pc.GetCapabilities())
	}
	p, err := id.Probe(ctx, &csi.ProbeRequest{})
	must(t, "Probe", err)
	if !p.GetReady().GetValue() {
		t.Error("Probe: not ready while serving")
	}
	cc, err := csi.NewControllerClient(conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	must(t, "ControllerGetCapabilities", err)
	if len(cc.GetCapabilities()) != 1 || cc.GetCapabilities()[0].GetRpc().GetType() != csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME {
		t.Errorf("controller capabilities = %v, want PUBLISH_UNPUBLISH_VOLUME only", cc.GetCapabilities())
	}
}

// Publish answers with the node it published to, the same on every call;
// unpublish succeeds whether or not the volume was published.
func TestControllerPublishIdempotent(t *testing.T) {
	conn, logs := startController(t)
	ctx := context.Background()
	ctl := csi.NewControllerClient(conn)
	for i := range 2 {
		r, err := ctl.ControllerPublishVolume(ctx, publishReq())
		must(t, "ControllerPublishVolume", err)
		if len(r.GetPublishContext()) != 1 || r.GetPublishContext()[PublishContextNode] != "node-b" {
			t.Fatalf("call %d: publish_context = %v, want only %s=node-b", i, r.GetPublishContext(), PublishContextNode)
		}
	}
	block := publishReq()
	block.VolumeCapability.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	block.VolumeCapability.AccessMode.Mode = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
	if _, err := ctl.ControllerPublishVolume(ctx, block); err != nil {
		t.Errorf("publish of a multi-writer block volume: %v", err)
	}
	for _, req := range []*csi.ControllerUnpublishVolumeRequest{
		{VolumeId: "vol-1", NodeId: "node-b"},
		{VolumeId: "vol-1", NodeId: "node-b"},
		{VolumeId: "never-published", NodeId: "node-c"},
		{VolumeId: "vol-1"}, // every node
	} {
		if _, err := ctl.ControllerUnpublishVolume(ctx, req); err != nil {
			t.Errorf("ControllerUnpublishVolume(%v): %v", req, err)
		}
	}
	if strings.Contains(logs.String(), "hunter2-secret") {
		t.Errorf("a secret in the controller's log:\n%s", logs)
	}
	if !strings.Contains(logs.String(), "method=/csi.v1.Controller/ControllerPublishVolume volume_id=vol-1 node_id=node-b msg=done") &&
		!strings.Contains(logs.String(), "msg=done method=/csi.v1.Controller/ControllerPublishVolume volume_id=vol-1 node_id=node-b") {
		t.Errorf("no log line for ControllerPublishVolume with the volume and the node:\n%s", logs)
	}
}

func TestControllerPublishRefusesBadInput(t *testing.T) {
	conn, _ := startController(t)
	ctl := csi.NewControllerClient(conn)
	for name, mutate := range map[string]func(*csi.ControllerPublishVolumeRequest){
		"no volume id":         func(r *csi.ControllerPublishVolumeRequest) { r.VolumeId = "" },
		"long volume id":       func(r *csi.ControllerPublishVolumeRequest) { r.VolumeId = strings.Repeat("v", 129) },
		"control in volume id": func(r *csi.ControllerPublishVolumeRequest) { r.VolumeId = "v\n1" },
		"no node id":           func(r *csi.ControllerPublishVolumeRequest) { r.NodeId = "" },
		"long node id":         func(r *csi.ControllerPublishVolumeRequest) { r.NodeId = strings.Repeat("n", 257) },
		"control in node id":   func(r *csi.ControllerPublishVolumeRequest) { r.NodeId = "node\x1b[1m" },
		"no capability":        func(r *csi.ControllerPublishVolumeRequest) { r.VolumeCapability = nil },
		"no access mode":       func(r *csi.ControllerPublishVolumeRequest) { r.VolumeCapability.AccessMode = nil },
		"unknown access mode":  func(r *csi.ControllerPublishVolumeRequest) { r.VolumeCapability.AccessMode.Mode = 99 },
		"no access type":       func(r *csi.ControllerPublishVolumeRequest) { r.VolumeCapability.AccessType = nil },
		"unknown fs type": func(r *csi.ControllerPublishVolumeRequest) {
			r.VolumeCapability.GetMount().FsType = "ntfs"
		},
		"bad mount flag": func(r *csi.ControllerPublishVolumeRequest) {
			r.VolumeCapability.GetMount().MountFlags = []string{"no-such-option"}
		},
		"multi-node writer filesystem": func(r *csi.ControllerPublishVolumeRequest) {
			r.VolumeCapability.AccessMode.Mode = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
		},
		"control in volume context": func(r *csi.ControllerPublishVolumeRequest) {
			r.VolumeContext = map[string]string{"file": "a\nb"}
		},
	} {
		t.Run(name, func(t *testing.T) {
			req := proto.Clone(publishReq()).(*csi.ControllerPublishVolumeRequest)
			mutate(req)
			_, err := ctl.ControllerPublishVolume(context.Background(), req)
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("got %v, want InvalidArgument", err)
			}
			if strings.Contains(err.Error(), "hunter2-secret") {
				t.Fatalf("error names a secret: %v", err)
			}
		})
	}
	for name, req := range map[string]*csi.ControllerUnpublishVolumeRequest{
		"no volume id":       {NodeId: "node-b"},
		"control in node id": {VolumeId: "vol-1", NodeId: "a\x00b"},
	} {
		if _, err := ctl.ControllerUnpublishVolume(context.Background(), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("unpublish, %s: got %v, want InvalidArgument", name, err)
		}
	}
}

// Everything berth controller does not serve says so.
func TestControllerRestUnimplemented(t *testing.T) {
	conn, _ := startController(t)
	ctx := context.Background()
	ctl := csi.NewControllerClient(conn)
	calls := map[string]func() error{
		"CreateVolume": func() error { _, err := ctl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x"}); return err },
		"DeleteVolume": func() error { _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "x"}); return err },
		"ListVolumes":  func() error { _, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{}); return err },
		"ControllerExpandVolume": func() error {
			_, err := ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "x"})
			return err
		},
		"NodeStageVolume": func() error {
			_, err := csi.NewNodeClient(conn).NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "x"})
			return err
		},
	}
	for name, call := range calls {
		if err := call(); status.Code(err) != codes.Unimplemented {
			t.Errorf("%s: got %v, want Unimplemented", name, err)
		}
	}
}

// What ControllerPublishVolume answers, the CO hands to NodeStageVolume
// and NodePublishVolume: a stage and a publish with it succeed, and a
// repeated stage with it is the same stage.
func TestPublishContextStages(t *testing.T) {
	conn, _ := startController(t)
	a, _, _ := newFakeAgent(t)
	preq := publishReq()
	preq.NodeId = a.cfg.NodeID
	pub, err := csi.NewControllerClient(conn).ControllerPublishVolume(context.Background(), preq)
	must(t, "ControllerPublishVolume", err)

	n := &nodeServer{a: a}
	ctx := context.Background()
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "s"), filepath.Join(dir, "t")
	must(t, "mkdir", mkdirAll(staging))
	req := stageReq("vol-1", staging, "1")

	// Published to another node: the stage is refused and records nothing.
	req.PublishContext = map[string]string{PublishContextNode: "node-b"}
	_, err = n.NodeStageVolume(ctx, req)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), `"node-b"`) {
		t.Fatalf("stage published to node-b on %s: %v; want FailedPrecondition naming node-b", a.cfg.NodeID, err)
	}
	if recs, _ := os.ReadDir(filepath.Join(a.cfg.StateDir, "volumes")); len(recs) != 0 {
		t.Fatalf("the refused stage left records: %v", recs)
	}

	req.PublishContext = pub.GetPublishContext()
	for i := range 2 {
		if _, err := n.NodeStageVolume(ctx, req); err != nil {
			t.Fatalf("stage %d with publish_context %v: %v", i, req.PublishContext, err)
		}
	}
	if _, err := n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: "vol-1", StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: req.VolumeCapability, VolumeContext: req.VolumeContext, PublishContext: req.PublishContext,
	}); err != nil {
		t.Fatalf("publish with publish_context %v: %v", req.PublishContext, err)
	}
}
