package iscsi_test

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
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestGuestISCSITrim: what berth trim runs beside serve (agent.TrimVolumes)
// gives the blocks of a deleted file back to the target: a thin LIO LUN
// (UNMAP passed on to a loop device over a sparse file) whose file's
// allocated bytes fall by about the deleted file's size.
func TestGuestISCSITrim(t *testing.T) {
	vm.RequireGuest(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	l := csitest.Listener(t)
	tr, err := iscsi.New(iscsi.Options{Listener: l, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(t.TempDir(), "state")
	node := csitest.StartAgentState(t, logger, l, state, agent.TransportFunc(agent.TransportKind{Name: iscsi.Name, Keys: iscsi.TransportKeys()}, tr.Parse))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddThinLUN(0, 512<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-trim", map[string]string{"iqn": lt.IQN, "lun": "0", "wwid": wwid, "targetPortal": "127.0.0.1:3260"})
	if err := v.stage(ctx); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	defer v.cleanup(t, ctx)
	if err := v.publishAt(ctx, v.target); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}

	const size = 128 << 20
	data := make([]byte, size)
	rand.Read(data)
	p := filepath.Join(v.target, "big")
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	before := target.Allocated(t, lt.LUNFile(0))
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	res, err := agent.TrimVolumes(ctx, state, []string{v.id})
	if err != nil || len(res) != 1 || res[0].Err != nil || res[0].Skipped != "" {
		t.Fatalf("TrimVolumes = %+v, %v", res, err)
	}
	after := target.Allocated(t, lt.LUNFile(0))
	t.Logf("LUN's backing file: %d bytes allocated with the file, %d after delete and trim (the filesystem reported %d trimmed)", before, after, res[0].Trimmed)
	if before-after < 100<<20 {
		t.Errorf("the trim gave back %d bytes of the LUN's file; want at least %d of the deleted %d", before-after, 100<<20, size)
	}
}
