package main

import (
	"context"
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

	"github.com/berth-csi/berth/agent"
)

// berth controller as the Deployment runs it: it serves on its socket,
// answers the external-attacher's calls, never logs a secret, and stops
// on SIGTERM, removing its socket. It needs no root.
func TestControllerCommand(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "csi", "csi.sock")
	p := serveBerth(t, "controller", "--endpoint=unix://"+sock, "--log-format=text", "--log-level=debug")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx := context.Background()
	deadline := time.Now().Add(20 * time.Second)
	for {
		info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		if err == nil {
			if info.GetName() != agent.DefaultDriverName {
				t.Fatalf("GetPluginInfo name %q", info.GetName())
			}
			break
		}
		if time.Now().After(deadline) || p.exited(0) {
			t.Fatalf("berth controller does not answer: %v\n%s", err, p.out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	ctl := csi.NewControllerClient(conn)
	req := &csi.ControllerPublishVolumeRequest{
		VolumeId: "pvc-1", NodeId: "node-a",
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
		Secrets: map[string]string{"chap-password": "s3cret-never-logged"},
	}
	r, err := ctl.ControllerPublishVolume(ctx, req)
	if err != nil || r.GetPublishContext()[agent.PublishContextNode] != "node-a" {
		t.Fatalf("ControllerPublishVolume: %v, %v", r, err)
	}
	req.NodeId = ""
	if _, err := ctl.ControllerPublishVolume(ctx, req); status.Code(err) != codes.InvalidArgument {
		t.Errorf("publish without a node: %v, want InvalidArgument", err)
	}
	if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "pvc-1", NodeId: "node-a"}); err != nil {
		t.Errorf("ControllerUnpublishVolume: %v", err)
	}
	if _, err := ctl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x"}); status.Code(err) != codes.Unimplemented {
		t.Errorf("CreateVolume: %v, want Unimplemented", err)
	}
	p.stop(t)
	if strings.Contains(p.out.String(), "s3cret-never-logged") {
		t.Errorf("a secret in berth controller's log:\n%s", p.out)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left after SIGTERM: %v", err)
	}
}
