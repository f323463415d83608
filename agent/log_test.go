package agent

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestStripSecrets(t *testing.T) {
	req := &csi.NodeStageVolumeRequest{
		VolumeId:      "v",
		Secrets:       map[string]string{"node.session.auth.password": "hunter2"},
		VolumeContext: map[string]string{"file": "a.img"},
	}
	s := stripSecrets(req).(*csi.NodeStageVolumeRequest)
	if s.Secrets["node.session.auth.password"] != strippedValue || s.VolumeContext["file"] != "a.img" {
		t.Fatalf("stripped: %v", s)
	}
	if req.Secrets["node.session.auth.password"] != "hunter2" {
		t.Fatal("stripSecrets changed the request")
	}

	// Through the interceptor at debug level: the request is logged,
	// the secret is not, and neither is it in the error.
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ic := logInterceptor(log)
	_, err := ic(context.Background(), req, &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Node/NodeStageVolume"}, func(ctx context.Context, _ any) (any, error) {
		return nil, toStatus(fmt.Errorf("login failed for hunter2: %w", errdefs.ErrPermissionDenied), req.Secrets)
	})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("interceptor changed the error: %v", err)
	}
	out := buf.String()
	if strings.Contains(out, "hunter2") {
		t.Fatalf("secret in the log:\n%s", out)
	}
	for _, want := range []string{`"volume_id":"v"`, "node.session.auth.password", `"code":"PermissionDenied"`} {
		if !strings.Contains(out, want) {
			t.Fatalf("log lacks %s:\n%s", want, out)
		}
	}
}
