package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// On shutdown a call in flight finishes (GracefulStop) and the hooks
// run in order: ready, stopping.
func TestServeFinishesCallsInFlight(t *testing.T) {
	a, _, tr := newFakeAgent(t)
	dir := t.TempDir()
	staging := filepath.Join(dir, "s")
	must(t, "mkdir", mkdirAll(staging))
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	lis, err := Listen(endpoint)
	must(t, "Listen", err)

	var events []string
	ready := make(chan struct{})
	a.cfg.OnReady = func() { events = append(events, "ready"); close(ready) }
	stopping := make(chan struct{})
	a.cfg.OnStopping = func() { events = append(events, "stopping"); close(stopping) }
	a.cfg.ShutdownTimeout = time.Minute
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- a.Serve(ctx, lis) }()
	<-ready

	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, "dial", err)
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	p, err := csi.NewIdentityClient(conn).Probe(context.Background(), &csi.ProbeRequest{})
	must(t, "Probe", err)
	if !p.GetReady().GetValue() {
		t.Fatal("not ready after OnReady")
	}

	release := tr.hold("1")
	staged := make(chan error, 1)
	go func() {
		_, err := node.NodeStageVolume(context.Background(), stageReq("vol", staging, "1"))
		staged <- err
	}()
	<-tr.entered
	cancel()
	<-stopping
	select {
	case err := <-served:
		t.Fatalf("Serve returned with a call in flight: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	release()
	must(t, "stage in flight during shutdown", <-staged)
	must(t, "Serve", <-served)
	if len(events) != 2 || events[0] != "ready" || events[1] != "stopping" {
		t.Fatalf("hooks: %v", events)
	}
	if _, err := os.Stat(filepath.Join(dir, "csi.sock")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind after Serve: %v", err)
	}
}
