package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/berth-csi/berth/devices"
)

// inventoryNode is a node with file volumes in every state Inventory
// tells apart, staged through a running agent: one staged and published
// as a filesystem, one raw block volume staged and published, one whose
// staging mount and loop device were taken away behind berth's back, a
// record file of garbage, and a loop device with berth's marker that no
// record names.
type inventoryNode struct {
	h                    *harness
	mounted, block, lost vol
	garbage              string // the unreadable record file
	orphan               *devices.Device
	orphanImage          string
}

func newInventoryNode(t *testing.T) *inventoryNode {
	h := newHarness(t)
	n := &inventoryNode{h: h}
	n.mounted = h.newVol("mounted", 64*mib, mountCap("ext4", snw))
	n.block = h.newVol("block", 32*mib, blockCap(snw))
	n.lost = h.newVol("lost", 64*mib, mountCap("ext4", snw))
	for _, v := range []vol{n.mounted, n.block} {
		must(t, "stage "+v.id, h.stage(v))
		must(t, "publish "+v.id, h.publish(v, false))
	}
	must(t, "stage "+n.lost.id, h.stage(n.lost))
	t.Cleanup(func() {
		for _, v := range []vol{n.mounted, n.block} {
			if err := h.unpublish(v); err != nil {
				t.Errorf("unpublish %s: %v", v.id, err)
			}
		}
		for _, v := range []vol{n.mounted, n.block, n.lost} {
			if err := h.unstage(v); err != nil {
				t.Errorf("unstage %s: %v", v.id, err)
			}
		}
	})

	// The lost volume: its staging mount unmounted, its loop device
	// detached, as an operator's umount and losetup -d would.
	rec, ok := h.agent.state.get(n.lost.id)
	if !ok || rec.Device == nil {
		t.Fatalf("no device recorded for %s", n.lost.id)
	}
	if err := syscall.Unmount(n.lost.staging, 0); err != nil {
		t.Fatal(err)
	}
	d, err := devices.Roots{}.Lookup(rec.Device.Name)
	if err != nil {
		t.Fatal(err)
	}
	if err := devices.DetachLoop(d); err != nil {
		t.Fatal(err)
	}

	n.garbage = filepath.Join(h.stateDir, "volumes", stateFileName("vol-garbage"))
	if err := os.WriteFile(n.garbage, []byte("{\"volumeID\": \"vol-garb"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(n.garbage) })

	// A loop device berth attached (its marker) whose record is gone:
	// outside the file root, so that the harness does not take it for
	// one of its volumes'.
	n.orphanImage = filepath.Join(h.dir, "orphan.img")
	f, err := os.Create(n.orphanImage)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(16 * mib); err != nil {
		t.Fatal(err)
	}
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if n.orphan, err = devices.AttachLoopFile(context.Background(), l, f, n.orphanImage, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := devices.DetachLoop(n.orphan); err != nil {
			t.Errorf("detach %s: %v", n.orphan.Path, err)
		}
	})
	return n
}

func (n *inventoryNode) inventory(t *testing.T) *NodeInventory {
	t.Helper()
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	inv, err := Inventory(context.Background(), InventoryConfig{StateDir: n.h.stateDir, Transports: []Transport{fileTransport(t, n.h.root, l)}})
	if err != nil {
		t.Fatal(err)
	}
	return inv
}

func inventoryVolumeOf(t *testing.T, inv *NodeInventory, id string) InventoryVolume {
	t.Helper()
	for _, v := range inv.Volumes {
		if v.VolumeID == id {
			return v
		}
	}
	t.Fatalf("inventory has no volume %s: %+v", id, inv.Volumes)
	return InventoryVolume{}
}

func hasProblem(v InventoryVolume, s string) bool {
	for _, p := range v.Problems {
		if strings.Contains(p, s) {
			return true
		}
	}
	return false
}

// Inventory reports each volume of a node as its record says and the
// kernel shows it, while the agent serves, and changes nothing.
func TestInventory(t *testing.T) {
	n := newInventoryNode(t)
	before := stateFiles(t, n.h)
	inv := n.inventory(t)
	if inv.Consistent() {
		t.Error("Consistent() with a lost volume, an unreadable record and an unrecorded loop device")
	}

	m := inventoryVolumeOf(t, inv, n.mounted.id)
	if m.Transport != "file" || m.TargetKey != filepath.Join(n.h.root, "mounted.img") || m.FsType != "ext4" || !m.Staged {
		t.Errorf("mounted volume: %+v", m)
	}
	if m.Device == nil || !m.Device.Present || m.Device.Kind != devices.KindLoop || m.Device.Identity != m.TargetKey {
		t.Errorf("mounted volume's device: %+v", m.Device)
	}
	if !m.Staging.Mounted || !m.Staging.ShowsVolume || m.Staging.FSType != "ext4" {
		t.Errorf("mounted volume's staging: %+v", m.Staging)
	}
	if len(m.Publishes) != 1 || m.Publishes[0].Path != n.mounted.target || !m.Publishes[0].Mounted || !m.Publishes[0].ShowsVolume {
		t.Errorf("mounted volume's publishes: %+v", m.Publishes)
	}
	if m.Usage == nil || m.Usage.TotalBytes <= 0 || m.Usage.TotalBytes > 64*mib || m.Usage.TotalInodes == 0 {
		t.Errorf("mounted volume's usage: %+v", m.Usage)
	}
	if m.Abnormal || len(m.Problems) > 0 || len(m.OtherMounts) > 0 {
		t.Errorf("mounted volume: abnormal %v (%s), problems %q, other mounts %q", m.Abnormal, m.Message, m.Problems, m.OtherMounts)
	}

	b := inventoryVolumeOf(t, inv, n.block.id)
	if b.AccessType != "block" || b.Device == nil || !b.Device.Present || b.Usage == nil || b.Usage.TotalBytes != 32*mib {
		t.Errorf("block volume: %+v, device %+v, usage %+v", b, b.Device, b.Usage)
	}
	if len(b.Publishes) != 1 || !b.Publishes[0].Mounted || !b.Publishes[0].ShowsVolume || b.Staging.Mounted {
		t.Errorf("block volume's mounts: staging %+v, publishes %+v", b.Staging, b.Publishes)
	}
	if b.Abnormal || len(b.Problems) > 0 {
		t.Errorf("block volume: abnormal %v (%s), problems %q", b.Abnormal, b.Message, b.Problems)
	}

	l := inventoryVolumeOf(t, inv, n.lost.id)
	if l.Device == nil || l.Device.Present || !l.Abnormal || l.Staging.Mounted || l.Usage != nil {
		t.Errorf("lost volume: %+v, device %+v", l, l.Device)
	}
	if !hasProblem(l, "is gone") || !hasProblem(l, "nothing is mounted at its staging path") {
		t.Errorf("lost volume's problems: %q", l.Problems)
	}

	if len(inv.UnreadableRecords) != 1 || inv.UnreadableRecords[0].Path != n.garbage || !strings.Contains(inv.UnreadableRecords[0].Error, "parse") {
		t.Errorf("unreadable records: %+v, want %s", inv.UnreadableRecords, n.garbage)
	}
	var found bool
	for _, o := range inv.UnrecordedLoops {
		switch o.File {
		case n.orphanImage:
			found = o.Device == n.orphan.Path && o.Major == n.orphan.Major && len(o.Mounts) == 0
		case filepath.Join(n.h.root, "mounted.img"), filepath.Join(n.h.root, "block.img"):
			t.Errorf("unrecorded loop devices list %s, a volume's", o.Device)
		}
	}
	if !found {
		t.Errorf("unrecorded loop devices: %+v, want %s of %s", inv.UnrecordedLoops, n.orphan.Path, n.orphanImage)
	}

	// Nothing changed: the same record files (the garbage kept), the
	// lost volume still without its mount, the agent still serving it.
	if after := stateFiles(t, n.h); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("state files before %q, after %q", before, after)
	}
	if mountsAt(t, n.lost.staging) != 0 {
		t.Errorf("%s mounted again", n.lost.staging)
	}
}
