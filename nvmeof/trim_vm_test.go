package nvmeof_test

import (
	"context"
	"crypto/rand"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestGuestTrim: what berth trim runs beside serve (agent.TrimVolumes)
// gives the blocks of a deleted file back to the target. The namespace's
// backing is a sparse file (nvmet's block backend on a loop device over
// tmpfs): its allocated bytes fall by about the file's size.
func TestGuestTrim(t *testing.T) {
	vm.RequireGuest(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	l := csitest.Listener(t)
	tr, err := nvmeof.NewTransport(nvmeof.Options{Listener: l, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(t.TempDir(), "state")
	node := csitest.StartAgentState(t, logger, l, state, agent.TransportFunc(agent.TransportKind{Name: nvmeof.Name, Keys: nvmeof.TransportKeys()}, tr.Parse))
	nqn := "nqn.2026-01.io.berth:trim"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4461"},
		Namespaces: []target.NVMeNamespace{{Size: 512 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-trim", map[string]string{"nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4461"})
	if err := v.stage(ctx); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	defer func() {
		if err := v.unpublish(ctx); err != nil {
			t.Errorf("NodeUnpublishVolume: %v", err)
		}
		if err := v.unstage(ctx); err != nil {
			t.Errorf("NodeUnstageVolume: %v", err)
		}
	}()
	if err := v.publish(ctx); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	backing := backingFile(t, tgt.BackingDevice(1))
	assertTrimGivesBack(t, ctx, state, v.id, v.target, backing)
}

// assertTrimGivesBack writes a 128 MiB file into the volume published at
// dir, deletes it, trims the volume through stateDir and checks that the
// target's backing file gave back at least 100 MiB.
func assertTrimGivesBack(t *testing.T, ctx context.Context, stateDir, id, dir, backing string) {
	t.Helper()
	const size = 128 << 20
	data := make([]byte, size)
	rand.Read(data)
	p := filepath.Join(dir, "big")
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	before := target.Allocated(t, backing)
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	res, err := agent.TrimVolumes(ctx, stateDir, []string{id})
	if err != nil || len(res) != 1 || res[0].Err != nil || res[0].Skipped != "" {
		t.Fatalf("TrimVolumes = %+v, %v", res, err)
	}
	after := target.Allocated(t, backing)
	t.Logf("target's backing file: %d bytes allocated with the file, %d after delete and trim (the filesystem reported %d trimmed)", before, after, res[0].Trimmed)
	if before-after < 100<<20 {
		t.Errorf("the trim gave back %d bytes of the target's file; want at least %d of the deleted %d", before-after, 100<<20, size)
	}
}
