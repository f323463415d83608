package iscsi_test

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/file"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
)

// TestMultipathISCSIInventory: what berth volumes shows (agent.Inventory,
// read beside serve) of a node with a two-path iSCSI volume and two file
// volumes: the map and both sessions live, then one portal lost (the
// condition names it); and a file volume whose loop device was detached
// behind berth's back, which the inventory reports as a disagreement
// between the record and the kernel.
func TestMultipathISCSIInventory(t *testing.T) {
	vm.RequireGuest(t)
	queueForever(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	l := csitest.Listener(t)
	it, err := iscsi.New(iscsi.Options{Listener: l, Logger: logger, Params: map[string]int{
		iscsi.ParamLoginTimeout: iscsi.DefaultLoginTimeout, iscsi.ParamLoginRetryMax: iscsi.DefaultLoginRetryMax}})
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(t.TempDir(), "images")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	ft, err := file.New(root, l)
	if err != nil {
		t.Fatal(err)
	}
	transports := []agent.Transport{
		agent.TransportFunc(agent.TransportKind{Name: iscsi.Name, Keys: iscsi.TransportKeys()}, it.Parse),
		agent.TransportFunc(agent.TransportKind{Name: file.Name, Keys: file.TransportKeys()}, ft.Parse),
	}
	state := filepath.Join(t.TempDir(), "state")
	node := csitest.StartAgentState(t, logger, l, state, transports...)
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260", "127.0.0.2:3260")
	wwid := lt.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()

	staging := filepath.Join(dir, "staging")
	os.MkdirAll(staging, 0o750)
	stageMultipath(t, ctx, node, lt, lt.IQN, wwid, "vol-iscsi", staging)
	for _, name := range []string{"a.img", "b.img"} {
		if err := os.WriteFile(filepath.Join(root, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(filepath.Join(root, name), 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	fileStaging := map[string]string{}
	for id, img := range map[string]string{"vol-file": "a.img", "vol-gone": "b.img"} {
		fileStaging[id] = filepath.Join(dir, id)
		os.MkdirAll(fileStaging[id], 0o750)
		if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: fileStaging[id],
			VolumeCapability: csitest.BlockCap(), VolumeContext: map[string]string{file.KeyFile: img}}); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", id, err)
		}
	}
	defer func() {
		for id, p := range fileStaging {
			if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: p}); err != nil {
				t.Errorf("NodeUnstageVolume %s: %v", id, err)
			}
		}
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol-iscsi", StagingTargetPath: staging}); err != nil {
			t.Errorf("NodeUnstageVolume vol-iscsi: %v", err)
		}
	}()

	inventory := func() (*agent.NodeInventory, map[string]agent.InventoryVolume) {
		t.Helper()
		inv, err := agent.Inventory(ctx, agent.InventoryConfig{StateDir: state, Transports: transports})
		if err != nil {
			t.Fatalf("Inventory: %v", err)
		}
		byID := map[string]agent.InventoryVolume{}
		for _, v := range inv.Volumes {
			byID[v.VolumeID] = v
		}
		return inv, byID
	}
	inv, vols := inventory()
	if len(vols) != 3 || !inv.Consistent() {
		t.Fatalf("Inventory: %d volumes, consistent %v: %+v", len(vols), inv.Consistent(), inv)
	}
	got := vols["vol-iscsi"]
	switch {
	case got.Transport != iscsi.Name || got.Device == nil || !got.Device.Present || !strings.HasPrefix(got.Device.Name, "dm-"):
		t.Errorf("iSCSI volume: transport %q device %+v: want the multipath map, present", got.Transport, got.Device)
	case !got.Staging.Mounted || !got.Staging.ShowsVolume || got.Staging.FSType != "ext4":
		t.Errorf("iSCSI staging %+v: want the volume's ext4 mounted", got.Staging)
	case got.Paths["live"] != 2 || got.Abnormal:
		t.Errorf("iSCSI paths %v abnormal %v (%s): want 2 live, normal", got.Paths, got.Abnormal, got.Message)
	}
	if f := vols["vol-file"]; f.Transport != file.Name || f.Device == nil || !f.Device.Present || !strings.HasPrefix(f.Device.Name, "loop") {
		t.Errorf("file volume: transport %q device %+v: want its loop device, present", f.Transport, f.Device)
	}
	t.Logf("both portals: iSCSI paths %v, condition %q", got.Paths, got.Message)

	// One portal lost.
	lt.Vanish(2)
	deadline := time.Now().Add(60 * time.Second)
	for _, vols = inventory(); vols["vol-iscsi"].Paths["live"] != 1 && time.Now().Before(deadline); _, vols = inventory() {
		time.Sleep(500 * time.Millisecond)
	}
	got = vols["vol-iscsi"]
	t.Logf("one portal lost: iSCSI paths %v, condition %q", got.Paths, got.Message)
	if got.Paths["live"] != 1 || !got.Abnormal || !strings.Contains(got.Message, lt.Portal(2)) {
		t.Errorf("paths %v abnormal %v (%s): want 1 live and the condition naming %s", got.Paths, got.Abnormal, got.Message, lt.Portal(2))
	}
	if got.Device == nil || !got.Device.Present || !got.Staging.ShowsVolume {
		t.Errorf("device %+v staging %+v: still the volume's with one path", got.Device, got.Staging)
	}
	lt.Restore(2)

	// A file volume's loop device detached behind berth's back: the
	// record names a device the kernel no longer has.
	gone := vols["vol-gone"]
	if gone.Device == nil {
		t.Fatal("vol-gone: no device recorded")
	}
	if out, err := exec.Command("losetup", "-d", "/dev/"+gone.Device.Name).CombinedOutput(); err != nil {
		t.Fatalf("losetup -d %s: %v: %s", gone.Device.Name, err, out)
	}
	inv, vols = inventory()
	gone = vols["vol-gone"]
	t.Logf("loop device detached behind berth: device %+v, problems %q", gone.Device, gone.Problems)
	if inv.Consistent() || gone.Device == nil || gone.Device.Present || len(gone.Problems) == 0 {
		t.Errorf("inventory with vol-gone's loop device detached: consistent %v, device %+v, problems %q: want the disagreement reported", inv.Consistent(), gone.Device, gone.Problems)
	}
	if f := vols["vol-file"]; len(f.Problems) > 0 || !f.Device.Present {
		t.Errorf("vol-file: problems %q, device %+v: the other file volume is as it was", f.Problems, f.Device)
	}
}
