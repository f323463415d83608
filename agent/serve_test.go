package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
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

// A step that a call left running in the kernel (an unmount whose
// writeback waits for the device, past the call's deadline) is waited for
// when berth stops: exiting would cut it, with the programs it runs.
// Past ShutdownTimeout, Serve returns without it.
func TestServeWaitsForStepsLeftRunning(t *testing.T) {
	for _, c := range []struct {
		name    string
		timeout time.Duration
		release bool // the step ends while Serve waits
	}{
		{"step ends", time.Minute, true},
		{"bounded", 300 * time.Millisecond, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, host, _ := newFakeAgent(t)
			dir := t.TempDir()
			staging := filepath.Join(dir, "s")
			must(t, "mkdir", mkdirAll(staging))
			n := &nodeServer{a: a}
			_, err := n.NodeStageVolume(context.Background(), stageReq("vol", staging, "1"))
			must(t, "stage", err)
			gate := make(chan struct{})
			host.mu.Lock()
			host.unmountGate = gate
			host.mu.Unlock()
			var once sync.Once
			open := func() { once.Do(func() { close(gate) }) }
			t.Cleanup(open)

			endpoint := "unix://" + filepath.Join(dir, "csi.sock")
			lis, err := Listen(endpoint)
			must(t, "Listen", err)
			ready := make(chan struct{})
			a.cfg.OnReady = func() { close(ready) }
			a.cfg.ShutdownTimeout = c.timeout
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			served := make(chan error, 1)
			go func() { served <- a.Serve(ctx, lis) }()
			<-ready

			conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
			must(t, "dial", err)
			defer conn.Close()
			cctx, ccancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer ccancel()
			if _, err := csi.NewNodeClient(conn).NodeUnstageVolume(cctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}); err == nil {
				t.Fatal("unstage answered OK with its unmount held")
			}

			start := time.Now()
			cancel()
			if !c.release {
				select {
				case err := <-served:
					must(t, "Serve", err)
				case <-time.After(10 * time.Second):
					t.Fatal("Serve still waits for the step 10s after its 300ms shutdown timeout")
				}
				if el := time.Since(start); el < c.timeout {
					t.Errorf("Serve returned after %v, before its shutdown timeout of %v with a step running", el, c.timeout)
				}
				return
			}
			select {
			case err := <-served:
				t.Fatalf("Serve returned with a step left running: %v", err)
			case <-time.After(300 * time.Millisecond):
			}
			open()
			must(t, "Serve", <-served)
			if ev := host.eventLog(); !slices.Contains(ev, "unmount "+staging) {
				t.Errorf("the unmount left running did not finish: %q", ev)
			}
		})
	}
}
