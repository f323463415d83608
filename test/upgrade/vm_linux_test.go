package upgrade

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// The guest has neither git nor Go: the host builds both berths and the
// guest finds them here.
const (
	guestV010 = "/usr/local/bin/berth-v0.1.0"
	guestCur  = "/usr/local/bin/berth-current"
)

// The targets' addresses in the guest (loopback).
const (
	nvmeAddr, nvmePort = "127.0.0.1", "4420"
	iscsiPortal        = "127.0.0.1:3260"
)

// TestVMUpgrade builds v0.1.0 and today's berth on the host and runs
// upgradeFromV010 and rollbackToV010 in one guest on NVMe/TCP volumes
// (nvmet) and iSCSI volumes (LIO and iscsid), ext4 and raw block each.
func TestVMUpgrade(t *testing.T) {
	if vm.InGuest() {
		t.Skip("host entry point")
	}
	for _, tool := range []string{"git", "go"} {
		_, err := exec.LookPath(tool)
		need(t, err == nil, tool)
	}
	old, cur := buildV010(t), currentBinary(t)
	start := time.Now()
	m := vm.Boot(t,
		vm.WithTestRun("^TestGuestV010"),
		vm.WithExtraFiles(map[string]string{old: guestV010, cur: guestCur}),
		vm.WithModules("nvmet", "nvmet_tcp", "nvme_tcp", "iscsi_tcp", "target_core_mod", "target_core_iblock", "iscsi_target_mod", "loop"),
		vm.WithIscsid(),
		vm.WithTimeout(12*time.Minute))
	m.ReportTests(t)
	t.Logf("upgrade guest: %v in all (boot %v)", time.Since(start).Round(time.Second), m.BootTime().Round(time.Millisecond))
}

// TestGuestV010Upgrade is upgradeFromV010 on NVMe/TCP and iSCSI volumes
// (in the guest of TestVMUpgrade).
func TestGuestV010Upgrade(t *testing.T) {
	vm.RequireGuest(t)
	upgradeFromV010(t, newGuestNode(t, "upgrade"), guestV010, guestCur)
}

// TestGuestV010Rollback is rollbackToV010 on NVMe/TCP and iSCSI volumes
// (in the guest of TestVMUpgrade).
func TestGuestV010Rollback(t *testing.T) {
	vm.RequireGuest(t)
	rollbackToV010(t, newGuestNode(t, "rollback"), guestV010, guestCur)
}

// TestGuestV010UnstagesFenced: v0.1.0, rolled back to with a volume
// today's berth fenced (an iSCSI LUN: LIO has reservations), unstages it
// without the reservation it does not know, which stays at the target
// (README's rollback rule); today's berth staging and unstaging the
// volume again on the node gives it back.
func TestGuestV010UnstagesFenced(t *testing.T) {
	vm.RequireGuest(t)
	n := newGuestNode(t, "fenced")
	v := n.vols[slices.IndexFunc(n.vols, func(v *volume) bool { return v.id == "iscsi-ext4" })]
	if !n.start(guestCur) {
		t.Fatalf("berth exited at start:\n%s", n.logs)
	}
	n.ok("NodeStageVolume", v, n.stage(v))
	n.stop()
	if !n.start(guestV010) {
		t.Fatalf("v0.1.0 exited at start:\n%s", n.logs)
	}
	n.ok("v0.1.0 NodeUnstageVolume", v, n.unstage(v))
	n.stop()
	left := n.host().kernel
	t.Logf("left by v0.1.0's unstage:\n\t%s", strings.Join(left, "\n\t"))
	if !slices.ContainsFunc(left, func(s string) bool { return strings.HasPrefix(s, "iSCSI LUN 0 reservation:") }) {
		t.Fatalf("v0.1.0's unstage gave back the reservation it does not know (README's rollback rule says it stays): %v", left)
	}
	if !n.start(guestCur) {
		t.Fatalf("berth exited at start:\n%s", n.logs)
	}
	n.ok("NodeStageVolume again", v, n.stage(v))
	n.ok("NodeUnstageVolume", v, n.unstage(v))
	n.stop()
	n.requireNothingLeft()
}

// newGuestNode is a node of an NVMe/TCP subsystem with two namespaces
// and an iSCSI target with two LUNs, one path each: an ext4 and a raw
// block volume of each transport, in the volume_context keys v0.1.0
// knows. The two volumes of a transport share its controller or session.
func newGuestNode(t *testing.T, name string) *node {
	nqn, iqn := "nqn.2026-01.io.berth:"+name, "iqn.2026-01.io.berth:"+name
	nt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{nvmeAddr + ":" + nvmePort},
		Namespaces: []target.NVMeNamespace{{Size: 64 * mib}, {Size: 64 * mib}}})
	it := target.NewISCSITarget(t, target.ISCSIConfig{IQN: iqn, Portals: []string{iscsiPortal},
		LUNs: []target.ISCSILUN{{Size: 64 * mib}, {Size: 64 * mib}}})
	nvme := func(id, fsType string, nsid uint32) *volume {
		return &volume{id: id, fsType: fsType, size: 64 * mib,
			vctx: map[string]string{"transport": "nvmeof", "nqn": nqn, "nsid": strconv.Itoa(int(nsid)), "traddr": nvmeAddr, "trsvcid": nvmePort},
			grow: func(size int64) { nt.Grow(nsid, size) }}
	}
	iscsi := func(id, fsType string, lun int) *volume {
		return &volume{id: id, fsType: fsType, size: 64 * mib,
			vctx: map[string]string{"transport": "iscsi", "targetPortal": iscsiPortal, "iqn": iqn, "lun": strconv.Itoa(lun)},
			grow: func(size int64) { it.Grow(lun, size) }}
	}
	vols := []*volume{nvme("nvme-ext4", "ext4", 1), nvme("nvme-block", "", 2), iscsi("iscsi-ext4", "ext4", 0), iscsi("iscsi-block", "", 1)}
	n := newNode(t, []string{"--transports", "nvmeof,iscsi"}, vols...)
	n.kernel = func() []string {
		var out []string
		for _, c := range nvmeControllers(nqn) {
			out = append(out, "NVMe controller "+c)
		}
		for _, s := range iscsiSessions(iqn) {
			out = append(out, "iSCSI session "+s)
		}
		for _, r := range iscsiRecords(iqn) {
			out = append(out, "iSCSI node record "+r)
		}
		out = append(out, reservations(it, 2)...)
		out = append(out, dmMaps()...)
		slices.Sort(out)
		return out
	}
	n.wantKernel = 3 // a controller, a session and its node record
	// The node's cleanup runs before the targets' (registered first).
	n.release = func() {
		for _, c := range nvmeControllers(nqn) {
			_ = os.WriteFile(filepath.Join("/sys/class/nvme", c, "delete_controller"), []byte("1"), 0o200)
		}
		if len(iscsiSessions(iqn)) > 0 {
			_ = exec.Command("iscsiadm", "-m", "node", "-T", iqn, "-p", iscsiPortal, "-u").Run()
		}
		if len(iscsiRecords(iqn)) > 0 {
			_ = exec.Command("iscsiadm", "-m", "node", "-T", iqn, "-p", iscsiPortal, "-o", "delete").Run()
		}
	}
	return n
}

// nvmeControllers lists the NVMe controllers of subsystem nqn, whatever
// their state.
func nvmeControllers(nqn string) []string {
	var out []string
	ents, _ := os.ReadDir("/sys/class/nvme")
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
		if err == nil && strings.TrimSpace(string(b)) == nqn {
			out = append(out, e.Name())
		}
	}
	return out
}

// iscsiSessions lists the iSCSI sessions of target iqn.
func iscsiSessions(iqn string) []string {
	var out []string
	ents, _ := os.ReadDir("/sys/class/iscsi_session")
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/iscsi_session", e.Name(), "targetname"))
		if err == nil && strings.TrimSpace(string(b)) == iqn {
			out = append(out, e.Name())
		}
	}
	return out
}

// iscsiRecords lists open-iscsi's node records of target iqn, in either
// of the directories open-iscsi keeps them.
func iscsiRecords(iqn string) []string {
	var out []string
	for _, dir := range []string{"/etc/iscsi/nodes", "/var/lib/iscsi/nodes"} {
		ents, _ := os.ReadDir(filepath.Join(dir, iqn))
		for _, e := range ents {
			out = append(out, filepath.Join(dir, iqn, e.Name()))
		}
	}
	return out
}

// reservations lists the persistent reservations and registrations LIO
// holds for the first luns LUNs of it: what berth's fencing took.
func reservations(it *target.ISCSITarget, luns int) []string {
	var out []string
	for i := range luns {
		if h := it.PR(i, "res_holder"); !strings.Contains(h, "No SPC-3 Reservation") {
			out = append(out, "iSCSI LUN "+strconv.Itoa(i)+" reservation: "+strings.Join(strings.Fields(h), " "))
		}
		if r := it.PR(i, "res_pr_registered_i_pts"); !strings.Contains(r, "None") {
			out = append(out, "iSCSI LUN "+strconv.Itoa(i)+" registrations: "+strings.Join(strings.Fields(r), " "))
		}
	}
	return out
}

// dmMaps lists the device-mapper maps of the guest: the volumes have one
// path each and no encryption, so any map is a leftover.
func dmMaps() []string {
	var out []string
	ents, _ := os.ReadDir("/sys/block")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "dm-") {
			name, _ := os.ReadFile(filepath.Join("/sys/block", e.Name(), "dm", "name"))
			out = append(out, "dm map "+e.Name()+" "+strconv.Quote(strings.TrimSpace(string(name))))
		}
	}
	return out
}
