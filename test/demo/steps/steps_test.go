package steps

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// liar answers every call with success and does nothing: a broken berth
// the steps must catch.
type liar struct {
	csi.UnimplementedNodeServer
	csi.UnimplementedIdentityServer
}

func (liar) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (liar) NodeStageVolume(context.Context, *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	return &csi.NodeStageVolumeResponse{}, nil
}

func serve(t *testing.T) *grpc.ClientConn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "csi.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	csi.RegisterNodeServer(s, liar{})
	csi.RegisterIdentityServer(s, liar{})
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func run(t *testing.T, v Volume) ([]string, error) {
	var lines []string
	r := New(serve(t), func(l string) { lines = append(lines, l) })
	v.ID, v.FsType, v.Work = "v", "ext4", t.TempDir()
	v.Context = map[string]string{"k": "v"}
	err := r.Lifecycle(v)
	for _, l := range lines {
		t.Log(l)
	}
	return lines, err
}

func TestStageWithoutMountFails(t *testing.T) {
	lines, err := run(t, Volume{})
	if err == nil || !strings.Contains(err.Error(), "nothing mounted at") {
		t.Fatalf("Lifecycle against a server that mounts nothing: %v", err)
	}
	last := lines[len(lines)-1]
	if !strings.Contains(last, "NodeStageVolume") || !strings.Contains(last, "FAILED") {
		t.Fatalf("last line %q, want the failed stage (no step after a failure)", last)
	}
}

func TestRefusedSecretsAcceptedFails(t *testing.T) {
	_, err := run(t, Volume{RefusedSecrets: map[string]string{"p": "wrong"}, RefusedCode: codes.PermissionDenied,
		RefusedStep: "stage with wrong secrets", RefusedWhy: "authentication"})
	if err == nil || !strings.Contains(err.Error(), "stage with wrong secrets: staged, want PermissionDenied") {
		t.Fatalf("Lifecycle against a server that ignores secrets: %v", err)
	}
}
