package nvmeof_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/reliability"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// rpcDeadline is the deadline of each unpublish and unstage below.
const rpcDeadline = 10 * time.Second

// timedRPC runs one call with rpcDeadline and fails the test when it ran
// past it. The client's own deadline ends the wait in any case, so what
// the server did shows in the next call: a handler still blocked in the
// kernel holds the volume's lock.
func timedRPC(t *testing.T, what string, call func(ctx context.Context) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcDeadline)
	defer cancel()
	start := time.Now()
	err := call(ctx)
	el := time.Since(start)
	t.Logf("%s: %v in %v", what, err, el.Round(time.Millisecond))
	if el > rpcDeadline+time.Second {
		t.Fatalf("%s ran %v, past its %v deadline", what, el, rpcDeadline)
	}
	return err
}

// controllerStates maps the controllers of subsystem nqn to their state.
func controllerStates(nqn string) map[string]string {
	out := map[string]string{}
	ents, _ := os.ReadDir("/sys/class/nvme")
	for _, e := range ents {
		d := filepath.Join("/sys/class/nvme", e.Name())
		b, err := os.ReadFile(filepath.Join(d, "subsysnqn"))
		if err != nil || strings.TrimSpace(string(b)) != nqn {
			continue
		}
		s, _ := os.ReadFile(filepath.Join(d, "state"))
		out[e.Name()] = strings.TrimSpace(string(s))
	}
	return out
}

// TestGuestAgentUnstageDeadController: the subsystem's ports are gone
// while the volume is staged, published and written to, and its
// controllers reconnect forever (ctrl_loss_tmo -1), so the namespace head
// queues I/O. Unpublish and unstage each return within their deadline,
// and a retry (the ports still gone) leaves no controller and no mount.
func TestGuestAgentUnstageDeadController(t *testing.T) {
	vm.RequireGuest(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))
	node := startAgent(t, logger)
	nqn := "nqn.2026-01.io.berth:deadctrl"
	ports := []string{"127.0.0.1:4450", "127.0.0.1:4451"}
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: ports, Namespaces: []target.NVMeNamespace{{Size: 64 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Whatever happens below, the controllers go when the test ends, so
	// that nothing stays blocked in the guest.
	t.Cleanup(func() {
		for c := range controllerStates(nqn) {
			os.WriteFile(filepath.Join("/sys/class/nvme", c, "delete_controller"), []byte("1"), 0o200)
		}
	})

	dir := t.TempDir()
	staging := filepath.Join(dir, "staging")
	targetPath := filepath.Join(dir, "pod", "vol")
	os.MkdirAll(staging, 0o750)
	os.MkdirAll(filepath.Dir(targetPath), 0o750)
	id := "vol-deadctrl"
	vctx := map[string]string{"nqn": nqn, "nsid": "1", "targets": strings.Join(ports, ","), "ctrlLossTmo": "-1", "ctrlLossForever": "true", "reconnectDelay": "1"}
	capability := csitest.MountCap("ext4")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: capability, VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: targetPath, VolumeCapability: capability, VolumeContext: vctx}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	f, err := os.OpenFile(filepath.Join(targetPath, "log"), os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	for range 32 {
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range ports {
		tgt.RemovePort(p)
	}
	// More writes land in the page cache while the controllers are down.
	for range 32 {
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	end := time.Now().Add(30 * time.Second)
	for {
		states := controllerStates(nqn)
		live := 0
		for _, s := range states {
			if s == "live" {
				live++
			}
		}
		if live == 0 && len(states) == len(ports) {
			t.Logf("controllers: %v", states)
			break
		}
		if time.Now().After(end) {
			t.Fatalf("controllers did not all drop: %v", states)
		}
		time.Sleep(100 * time.Millisecond)
	}

	if err := timedRPC(t, "NodeUnpublishVolume", func(ctx context.Context) error {
		_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetPath})
		return err
	}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	unstage := func(ctx context.Context) error {
		_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		return err
	}
	if err := timedRPC(t, "NodeUnstageVolume", unstage); err != nil {
		// A first call may end at its deadline; the retry must finish.
		if err := timedRPC(t, "NodeUnstageVolume (retry)", unstage); err != nil {
			t.Fatalf("NodeUnstageVolume retry with every controller down: %v", err)
		}
	}
	if st, err := fs.StatPath(staging); err == nil && st.MountRoot {
		t.Errorf("%s is still mounted", staging)
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if states := controllerStates(nqn); len(states) != 0 {
		t.Errorf("controllers left: %v", fmt.Sprint(states))
	}
}

// TestFaultUnstageOutage: both ports of a two-path volume go away
// just before its unstage and come back 3 s into it (a switch failing
// over, a target restarting). The unstage waits for a controller to be
// live again, with the head still queueing, so that the dirty pages
// written before it reach the namespace: staged again, the volume holds
// every byte.
func TestFaultUnstageOutage(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "NVMe/TCP two paths: both ports down for 3 s during an unstage with dirty pages, then staged again")
	node := fault.Node(startAgent(t, slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))))
	nqn := "nqn.2026-01.io.berth:blip"
	ports := []string{"127.0.0.1:4456", "127.0.0.1:4457"}
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: ports, Namespaces: []target.NVMeNamespace{{Size: 64 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	t.Cleanup(func() {
		for c := range controllerStates(nqn) {
			os.WriteFile(filepath.Join("/sys/class/nvme", c, "delete_controller"), []byte("1"), 0o200)
		}
	})
	staging := filepath.Join(t.TempDir(), "staging")
	os.MkdirAll(staging, 0o750)
	id := "vol-blip"
	vctx := map[string]string{"nqn": nqn, "nsid": "1", "targets": strings.Join(ports, ","), "ctrlLossTmo": "60", "reconnectDelay": "1"}
	stage := func() {
		t.Helper()
		if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			VolumeCapability: csitest.MountCap("ext4"), VolumeContext: vctx}); err != nil {
			t.Fatalf("NodeStageVolume: %v", err)
		}
	}
	stage()
	// Dirty pages, not yet written back: 4 MiB of a known pattern.
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i*7 + i>>12)
	}
	if err := os.WriteFile(filepath.Join(staging, "data"), want, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range ports {
		tgt.RemovePort(p)
	}
	uctx, ucancel := context.WithTimeout(ctx, time.Minute)
	defer ucancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := node.NodeUnstageVolume(uctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		done <- err
	}()
	time.Sleep(3 * time.Second)
	for _, p := range ports {
		tgt.AddPort(p)
	}
	if err := <-done; err != nil {
		t.Fatalf("NodeUnstageVolume through a 3 s outage: %v after %v", err, time.Since(start))
	}
	t.Logf("unstage through a 3 s outage took %v", time.Since(start).Round(time.Millisecond))
	if c := controllerStates(nqn); len(c) != 0 {
		t.Errorf("controllers left after the unstage: %v", c)
	}

	stage()
	got, err := os.ReadFile(filepath.Join(staging, "data"))
	lost := differing(got, want)
	fault.Lost(lost)
	if err != nil || lost > 0 {
		t.Errorf("staged again, the file holds %d bytes (%v), %d of the %d written differ", len(got), err, lost, len(want))
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	fault.Leaked(len(controllerStates(nqn)))
}
