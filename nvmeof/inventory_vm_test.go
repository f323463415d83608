package nvmeof_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestGuestInventory: what berth volumes shows (agent.Inventory, read
// beside serve) of a staged and published two-path NVMe/TCP volume, then
// with one path lost: the device present, both mounts, the path counts by
// state, and the condition naming the lost path; the records and the
// kernel agree throughout.
func TestGuestInventory(t *testing.T) {
	vm.RequireGuest(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	l := csitest.Listener(t)
	tr, err := nvmeof.NewTransport(nvmeof.Options{Listener: l, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	transport := agent.TransportFunc(agent.TransportKind{Name: nvmeof.Name, Keys: nvmeof.TransportKeys()}, tr.Parse)
	state := filepath.Join(t.TempDir(), "state")
	node := csitest.StartAgentState(t, logger, l, state, transport)
	nqn := "nqn.2026-01.io.berth:inventory"
	ports := []string{"127.0.0.1:4462", "127.0.0.1:4463"}
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: ports})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-inventory", map[string]string{"nqn": nqn, "nsid": "1", "targets": strings.Join(ports, ","),
		"ctrlLossTmo": "60", "reconnectDelay": "1"})
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

	inventory := func() agent.InventoryVolume {
		t.Helper()
		inv, err := agent.Inventory(ctx, agent.InventoryConfig{StateDir: state, Transports: []agent.Transport{transport}})
		if err != nil {
			t.Fatalf("Inventory: %v", err)
		}
		if len(inv.Volumes) != 1 || !inv.Consistent() {
			t.Fatalf("Inventory: %d volumes, consistent %v: %+v", len(inv.Volumes), inv.Consistent(), inv)
		}
		return inv.Volumes[0]
	}
	got := inventory()
	switch {
	case got.VolumeID != v.id || !got.Staged || got.Transport != nvmeof.Name:
		t.Errorf("volume %q staged %v transport %q", got.VolumeID, got.Staged, got.Transport)
	case got.Device == nil || !got.Device.Present || !strings.HasPrefix(got.Device.Name, "nvme"):
		t.Errorf("device %+v: want the namespace's head, present", got.Device)
	case !got.Staging.Mounted || !got.Staging.ShowsVolume || got.Staging.FSType != "ext4":
		t.Errorf("staging %+v: want the volume's ext4 mounted", got.Staging)
	case len(got.Publishes) != 1 || !got.Publishes[0].ShowsVolume:
		t.Errorf("publishes %+v: want the target path showing the volume", got.Publishes)
	case got.Paths["live"] != 2 || got.Abnormal:
		t.Errorf("paths %v abnormal %v (%s): want 2 live, normal", got.Paths, got.Abnormal, got.Message)
	}
	t.Logf("both paths: paths %v, condition %q", got.Paths, got.Message)

	tgt.RemovePort(ports[1])
	deadline := time.Now().Add(30 * time.Second)
	for got = inventory(); got.Paths["live"] != 1 && time.Now().Before(deadline); got = inventory() {
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("one path lost: paths %v, condition %q", got.Paths, got.Message)
	if got.Paths["live"] != 1 || !got.Abnormal || !strings.Contains(got.Message, ports[1]) {
		t.Errorf("paths %v abnormal %v (%s): want 1 live and the condition naming %s", got.Paths, got.Abnormal, got.Message, ports[1])
	}
	if got.Device == nil || !got.Device.Present || !got.Staging.ShowsVolume {
		t.Errorf("device %+v staging %+v: still the volume's with one path", got.Device, got.Staging)
	}
	tgt.AddPort(ports[1])
}
