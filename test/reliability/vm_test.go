package reliability

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// The VM crash suites run crashEveryStep in one guest per transport,
// against a target in the same guest: nvmet for NVMe/TCP, LIO with
// iscsid for iSCSI. Every crash run gets a target of its own, so each
// run's first stage formats and nothing of one run meets the next.

// vmLifecycles are the lifecycles of the VM suites. ext4 grows online
// in the guest; xfs (300 MB at least) is the host suite's.
func vmLifecycles() []lifecycle {
	return []lifecycle{
		{name: "ext4", fsType: "ext4", size: 64 * mib, expand: true},
		{name: "block", size: 64 * mib, expand: true},
	}
}

// boundariesEnv passes the host's list of a transport's source
// boundaries to the guest, which has no source.
const boundariesEnv = "BERTH_CRASH_BOUNDARIES"

// parallelEnv overrides how many crash runs the NVMe/TCP and iSCSI guest
// suites run at once (1: one by one, to tell a race between runs from
// one within a run); the host passes it on to the guest.
const parallelEnv = "BERTH_CRASH_PARALLEL"

// TestVMCrashNVMeoF crashes berth at every step of NVMe/TCP volumes in a
// guest (see TestGuestCrashNVMeoF).
func TestVMCrashNVMeoF(t *testing.T) {
	runCrashGuest(t, "nvmeof", "^TestGuestCrashNVMeoF$", nil)
}

// TestVMCrashISCSI crashes berth at every step of iSCSI volumes in a
// guest (see TestGuestCrashISCSI).
func TestVMCrashISCSI(t *testing.T) {
	runCrashGuest(t, "iscsi", "^TestGuestCrashISCSI$", fenceBoundaries,
		vm.WithIscsid(),
		vm.WithModules("iscsi_tcp", "target_core_mod", "target_core_iblock", "iscsi_target_mod", "loop"))
}

// runCrashGuest boots one guest whose berth is built with failpoints,
// runs the transport's crash suite there and adds its rows to the
// reliability table. The suite must reach every boundary of the
// transport's package and those of also.
func runCrashGuest(t *testing.T, transport, run string, also []string, opts ...vm.Option) {
	if vm.InGuest() {
		t.Skip("host entry point")
	}
	start := time.Now()
	opts = append(opts,
		vm.WithTestRun(run),
		vm.WithBerthTags("failpoints"),
		vm.WithEnv(map[string]string{
			"BERTH_FAILPOINT_BIN": "/usr/bin/berth",
			boundariesEnv:         strings.Join(append(sourceBoundaries(t, transport), also...), ","),
			parallelEnv:           os.Getenv(parallelEnv),
		}),
		vm.WithTimeout(30*time.Minute))
	m := vm.Boot(t, opts...)
	m.ReportTests(t)
	rows, failures := guestReport(m.Output())
	if len(rows) == 0 {
		t.Error("the guest reported no table row")
	}
	reportTable(t, rows, failures)
	t.Logf("%s crash suite: %v in all (boot %v)", transport, time.Since(start).Round(time.Second), m.BootTime().Round(time.Millisecond))
}

// guestCrashSuite runs crashEveryStep for each VM lifecycle, parallel
// runs at once, and fails when a boundary of the transport's package is
// not reached.
func guestCrashSuite(t *testing.T, transport string, mk newBackend, parallel int) {
	vm.RequireGuest(t)
	want := strings.Split(os.Getenv(boundariesEnv), ",")
	if len(want) == 0 || want[0] == "" {
		t.Fatalf("%s is empty: run through TestVMCrash*", boundariesEnv)
	}
	if v := os.Getenv(parallelEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a number of runs, 1 or more", parallelEnv, v)
		}
		parallel = n
	}
	bin := failpointBinary(t)
	reached := map[string]bool{}
	var rows []string
	for _, lc := range vmLifecycles() {
		rows = append(rows, crashEveryStep(t, bin, transport, lc, mk, reached, parallel).row())
	}
	reportTable(t, rows, failedRuns.take())
	if t.Failed() {
		return
	}
	t.Run("every "+transport+" boundary is covered", func(t *testing.T) {
		requireReached(t, want, reached)
	})
}

var targetSeq atomic.Int32

// nvmeBackend is a namespace of an nvmet subsystem of its own, reached
// over two NVMe/TCP paths on loopback.
type nvmeBackend struct {
	tgt *target.NVMeTarget
	nqn string
}

var nvmePorts = []string{"127.0.0.1:4460", "127.0.0.1:4461"}

func newNVMeBackend(t *testing.T, dir string, size int64) backend {
	nqn := fmt.Sprintf("nqn.2026-01.io.berth:crash-%d", targetSeq.Add(1))
	b := &nvmeBackend{nqn: nqn}
	b.tgt = target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: nvmePorts, Namespaces: []target.NVMeNamespace{{Size: size}}})
	// Registered after the target, so run before its removal: a failed
	// run's controllers go first.
	t.Cleanup(func() {
		for _, c := range b.controllers() {
			_ = os.WriteFile(filepath.Join("/sys/class/nvme", c, "delete_controller"), []byte("1"), 0o200)
		}
	})
	return b
}

func (b *nvmeBackend) args() []string { return []string{"--transports", "nvmeof"} }

func (b *nvmeBackend) volumeContext() map[string]string {
	return map[string]string{"transport": "nvmeof", "nqn": b.nqn, "nsid": "1", "targets": strings.Join(nvmePorts, ",")}
}

func (b *nvmeBackend) grow(t *testing.T, size int64) { b.tgt.Grow(1, size) }

// controllers lists the NVMe controllers of the subsystem, whatever
// their state.
func (b *nvmeBackend) controllers() []string {
	var out []string
	ents, _ := os.ReadDir("/sys/class/nvme")
	for _, e := range ents {
		nqn, err := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
		if err == nil && strings.TrimSpace(string(nqn)) == b.nqn {
			out = append(out, e.Name())
		}
	}
	return out
}

func (b *nvmeBackend) leftovers() []string {
	var out []string
	for _, c := range b.controllers() {
		out = append(out, "NVMe controller "+c)
	}
	return append(out, dmMaps()...)
}

// iscsiBackend is LUN 0 of a LIO target of its own at one portal.
type iscsiBackend struct {
	tgt *target.ISCSITarget
	iqn string
}

const iscsiPortal = "127.0.0.1:3260"

func newISCSIBackend(t *testing.T, dir string, size int64) backend {
	iqn := fmt.Sprintf("iqn.2026-01.io.berth:crash-%d", targetSeq.Add(1))
	b := &iscsiBackend{iqn: iqn}
	b.tgt = target.NewISCSITarget(t, target.ISCSIConfig{IQN: iqn, Portals: []string{iscsiPortal}, LUNs: []target.ISCSILUN{{Size: size}}})
	t.Cleanup(func() {
		if len(b.sessions()) > 0 {
			_ = exec.Command("iscsiadm", "-m", "node", "-T", iqn, "-p", iscsiPortal, "-u").Run()
		}
		if len(b.records()) > 0 {
			_ = exec.Command("iscsiadm", "-m", "node", "-T", iqn, "-p", iscsiPortal, "-o", "delete").Run()
		}
	})
	return b
}

func (b *iscsiBackend) args() []string { return []string{"--transports", "iscsi"} }

func (b *iscsiBackend) volumeContext() map[string]string {
	return map[string]string{"transport": "iscsi", "targetPortal": iscsiPortal, "iqn": b.iqn, "lun": "0"}
}

func (b *iscsiBackend) grow(t *testing.T, size int64) { b.tgt.Grow(0, size) }

// sessions lists the iSCSI sessions of the target.
func (b *iscsiBackend) sessions() []string {
	var out []string
	ents, _ := os.ReadDir("/sys/class/iscsi_session")
	for _, e := range ents {
		name, err := os.ReadFile(filepath.Join("/sys/class/iscsi_session", e.Name(), "targetname"))
		if err == nil && strings.TrimSpace(string(name)) == b.iqn {
			out = append(out, e.Name())
		}
	}
	return out
}

// records lists open-iscsi's node records of the target, in either of
// the directories open-iscsi keeps them.
func (b *iscsiBackend) records() []string {
	var out []string
	for _, dir := range []string{"/etc/iscsi/nodes", "/var/lib/iscsi/nodes"} {
		ents, _ := os.ReadDir(filepath.Join(dir, b.iqn))
		for _, e := range ents {
			out = append(out, filepath.Join(dir, b.iqn, e.Name()))
		}
	}
	return out
}

func (b *iscsiBackend) leftovers() []string {
	var out []string
	for _, s := range b.sessions() {
		out = append(out, "iSCSI session "+s)
	}
	for _, r := range b.records() {
		out = append(out, "iSCSI node record "+r)
	}
	return append(out, dmMaps()...)
}

// dmMaps lists the device-mapper maps of the guest: the suites use
// none, so any is a leftover.
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

// TestGuestCrashNVMeoF: crashEveryStep on NVMe/TCP volumes; after each
// run no controller of the subsystem is left, nor a mount, a dm map or
// a state record. Two runs go at once (each with a subsystem of its
// own), using both guest CPUs and crossing one volume's detach with
// another's attach.
func TestGuestCrashNVMeoF(t *testing.T) {
	guestCrashSuite(t, "nvmeof", newNVMeBackend, 2)
}

// TestGuestCrashISCSI: crashEveryStep on iSCSI volumes; after each run
// no session of the target is left, nor a node record, a mount, a dm map
// or a state record. Two runs go at once (each with a target of its own
// behind the one portal, and a berth of its own), so that one berth's
// logins and record deletions cross the other's, on one node's records.
func TestGuestCrashISCSI(t *testing.T) {
	guestCrashSuite(t, "iscsi", newISCSIBackend, 2)
}

// TestVMCrashEncrypted crashes berth at every step of encrypted (LUKS2)
// file volumes in a guest, the host having no device-mapper (see
// TestGuestCrashEncrypted).
func TestVMCrashEncrypted(t *testing.T) {
	bootEncrypted(t, "^TestGuestCrashEncrypted$", 40*time.Minute)
}

// TestVMEncryptedTransports runs the encrypted lifecycles on NVMe/TCP
// and iSCSI in a guest (see TestGuestEncryptedTransports).
func TestVMEncryptedTransports(t *testing.T) {
	bootEncrypted(t, "^TestGuestEncryptedTransports$", 10*time.Minute)
}

// bootEncrypted boots a guest with dm-crypt, nvmet, LIO and iscsid whose
// berth is built with failpoints, and runs the in-guest tests run
// there, adding their rows to the reliability table.
func bootEncrypted(t *testing.T, run string, timeout time.Duration) {
	if vm.InGuest() {
		t.Skip("host entry point")
	}
	start := time.Now()
	m := vm.Boot(t,
		vm.WithTestRun(run),
		vm.WithBerthTags("failpoints"),
		vm.WithIscsid(),
		vm.WithModules("loop", "dm_crypt", "xts", "aesni_intel", "nvmet", "nvmet_tcp", "nvme_tcp",
			"iscsi_tcp", "target_core_mod", "target_core_iblock", "iscsi_target_mod"),
		vm.WithEnv(map[string]string{"BERTH_FAILPOINT_BIN": "/usr/bin/berth", encryptedLifecyclesEnv: os.Getenv(encryptedLifecyclesEnv)}),
		vm.WithTimeout(timeout))
	m.ReportTests(t)
	if rows, failures := guestReport(m.Output()); len(rows) > 0 || len(failures) > 0 {
		reportTable(t, rows, failures)
	}
	t.Logf("%s: %v in all (boot %v)", run, time.Since(start).Round(time.Second), m.BootTime().Round(time.Millisecond))
}

// encryptedLifecyclesEnv names the encrypted lifecycles the crash suite
// runs, comma separated (default: all). Every luksFormat and open costs
// seconds in a guest without KVM: make test runs ext4-luks, make
// reliability both.
const encryptedLifecyclesEnv = "BERTH_ENCRYPTED_CRASH_LIFECYCLES"

// encryptedCrashLifecycles are the encrypted lifecycles the crash suite
// runs: those named by encryptedLifecyclesEnv, or all.
func encryptedCrashLifecycles(t *testing.T) []lifecycle {
	names := os.Getenv(encryptedLifecyclesEnv)
	if names == "" {
		return encryptedLifecycles()
	}
	var out []lifecycle
	for _, name := range strings.Split(names, ",") {
		i := slices.IndexFunc(encryptedLifecycles(), func(lc lifecycle) bool { return lc.name == name })
		if i < 0 {
			t.Fatalf("%s: no encrypted lifecycle %q", encryptedLifecyclesEnv, name)
		}
		out = append(out, encryptedLifecycles()[i])
	}
	return out
}

// encryptedLifecycles are the encrypted lifecycles: ext4 and raw block,
// each grown online.
func encryptedLifecycles() []lifecycle {
	return []lifecycle{
		{name: "ext4-luks", fsType: "ext4", size: 64 * mib, expand: true, encrypted: true},
		{name: "block-luks", size: 64 * mib, expand: true, encrypted: true},
	}
}

// TestGuestCrashEncrypted: crashEveryStep on encrypted file volumes;
// after each run no dm-crypt mapping, loop device, mount or record is
// left, and the data written before the crash reads back. Two runs go at
// once, each with a volume ID (so a mapping name) of its own.
func TestGuestCrashEncrypted(t *testing.T) {
	vm.RequireGuest(t)
	bin := failpointBinary(t)
	reached := map[string]bool{}
	var rows []string
	for _, lc := range encryptedCrashLifecycles(t) {
		rows = append(rows, crashEveryStep(t, bin, "file", lc, newFileBackend, reached, 2).row())
	}
	reportTable(t, rows, failedRuns.take())
	if t.Failed() {
		return
	}
	t.Run("every encrypted boundary is covered", func(t *testing.T) {
		requireReached(t, encryptedBoundaries, reached)
	})
}

// TestGuestEncryptedTransports runs the encrypted lifecycles once on
// NVMe/TCP and on iSCSI: stage (luksFormat, open, mkfs), publish,
// write, expand (rescan, cryptsetup resize, grow), unstage (close,
// detach), stage again and read back. The target's backing device
// holds ciphertext only: the data written is not found on it.
func TestGuestEncryptedTransports(t *testing.T) {
	vm.RequireGuest(t)
	bin := failpointBinary(t)
	for _, be := range []struct {
		name    string
		mk      newBackend
		backing func(backend) string
	}{
		{"nvmeof", newNVMeBackend, func(b backend) string { return b.(*nvmeBackend).tgt.BackingDevice(1) }},
		{"iscsi", newISCSIBackend, func(b backend) string { return b.(*iscsiBackend).tgt.BackingDevice(0) }},
	} {
		for _, lc := range encryptedLifecycles() {
			t.Run(be.name+"/"+lc.name, func(t *testing.T) {
				start := time.Now()
				e := newEnv(t, bin, lc, be.mk)
				e.start()
				e.run()
				e.stop()
				if left := e.leftovers(); len(left) > 0 {
					t.Fatalf("left %q", left)
				}
				dev := be.backing(e.be)
				b, err := os.ReadFile(dev)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.HasPrefix(b, []byte("LUKS\xba\xbe")) {
					t.Fatalf("backing device %s does not start with a LUKS header", dev)
				}
				if bytes.Contains(b, e.payload) {
					t.Fatalf("backing device %s holds the data written in plaintext", dev)
				}
				if bytes.Contains(b, []byte(cryptPassphrase)) {
					t.Fatalf("backing device %s holds the passphrase", dev)
				}
				t.Logf("%s %s: encrypted lifecycle in %v; %d bytes of the backing device hold no plaintext", be.name, lc.name, time.Since(start).Round(time.Millisecond), len(b))
			})
		}
	}
}
