package iscsi

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/berth-csi/berth/test/vm"
)

// An LIO iSCSI target built through configfs inside a test guest: iblock
// backstores over loop devices, one TPG per portal, demo mode (any
// initiator), optional CHAP.

const lioRoot = "/sys/kernel/config/target"

var lioSeq atomic.Int64

type lioTarget struct {
	t    *testing.T
	IQN  string
	tpgs map[int]string // tpgt -> portal ip:port
	luns map[int]*lioLUN
	// retired are LUNs replaced by ReplaceLUN, removed with the target.
	retired []*lioLUN
	// destroyed: the target and its backing files are gone (once only:
	// a loop device's number may be another LUN's by the second time).
	destroyed bool
}

type lioLUN struct {
	file, loop, core, serial string
	size                     int64
}

func lioWrite(t *testing.T, path, v string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(v), 0o644); err != nil {
		t.Fatalf("LIO: write %q to %s: %v", v, path, err)
	}
}

func lioMkdir(t *testing.T, path string) {
	t.Helper()
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatalf("LIO: %v", err)
	}
}

// newLIOTarget creates a target with one enabled TPG per portal.
func newLIOTarget(t *testing.T, portals ...string) *lioTarget {
	t.Helper()
	vm.RequireGuest(t)
	n := lioSeq.Add(1)
	tg := &lioTarget{t: t, IQN: fmt.Sprintf("iqn.2003-01.org.linux-iscsi.berth:t%d", n), tpgs: map[int]string{}, luns: map[int]*lioLUN{}}
	// LIO keeps APTPL registrations (berth's fencing asks for APTPL
	// through sd) under its dbroot's pr directory, which it never
	// creates: without it every REGISTER reports failure.
	if b, err := os.ReadFile(filepath.Join(lioRoot, "dbroot")); err == nil {
		if err := os.MkdirAll(filepath.Join(strings.TrimSpace(string(b)), "pr"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	base := filepath.Join(lioRoot, "iscsi", tg.IQN)
	if err := os.MkdirAll(base, 0o755); err != nil {
		t.Fatalf("LIO: create target (is iscsi_target_mod loaded?): %v", err)
	}
	t.Cleanup(tg.destroy)
	for i, p := range portals {
		tpgt := i + 1
		tpg := filepath.Join(base, "tpgt_"+strconv.Itoa(tpgt))
		lioMkdir(t, tpg)
		lioMkdir(t, filepath.Join(tpg, "np", p))
		for k, v := range map[string]string{"generate_node_acls": "1", "demo_mode_write_protect": "0", "cache_dynamic_acls": "1", "authentication": "0"} {
			lioWrite(t, filepath.Join(tpg, "attrib", k), v)
		}
		lioWrite(t, filepath.Join(tpg, "enable"), "1")
		tg.tpgs[tpgt] = p
	}
	return tg
}

func (tg *lioTarget) tpgDir(tpgt int) string {
	return filepath.Join(lioRoot, "iscsi", tg.IQN, "tpgt_"+strconv.Itoa(tpgt))
}

// AddLUN exports a new zeroed LUN of size bytes on every TPG and returns
// the WWID the initiator will see. It is an iblock backstore over a loop
// device, so it can grow.
func (tg *lioTarget) AddLUN(lun int, size int64) string { return tg.addLUN(lun, size, false) }

// AddThinLUN is AddLUN for a thin-provisioned LUN (emulate_tpu: the disk
// accepts UNMAP and passes it on to its loop device, which punches the
// blocks out of its sparse file, LUNFile).
func (tg *lioTarget) AddThinLUN(lun int, size int64) string {
	wwid := tg.addLUN(lun, size, false)
	// LIO reads the attribute when the initiator asks for the
	// thin-provisioning VPD page, after the LUN is linked.
	lioWrite(tg.t, filepath.Join(tg.luns[lun].core, "attrib", "emulate_tpu"), "1")
	return wwid
}

// LUNFile is the sparse file behind a LUN.
func (tg *lioTarget) LUNFile(lun int) string { return tg.luns[lun].file }

// AddCachedLUN exports a buffered fileio LUN, which reports a volatile
// write cache, as arrays do: the initiator sends SYNCHRONIZE CACHE when
// such a disk is removed.
func (tg *lioTarget) AddCachedLUN(lun int, size int64) string { return tg.addLUN(lun, size, true) }

func (tg *lioTarget) addLUN(lun int, size int64, cached bool) string {
	t := tg.t
	t.Helper()
	n := lioSeq.Add(1)
	l := &lioLUN{file: filepath.Join("/tmp", fmt.Sprintf("lio-%d.img", n)), size: size}
	if err := os.WriteFile(l.file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(l.file, size); err != nil {
		t.Fatal(err)
	}
	kind, control := "fileio", fmt.Sprintf("fd_dev_name=%s,fd_dev_size=%d,fd_buffered_io=1", l.file, size)
	if !cached {
		out, err := exec.Command("losetup", "-f", "--show", l.file).CombinedOutput()
		if err != nil {
			t.Fatalf("losetup: %v: %s", err, out)
		}
		l.loop = strings.TrimSpace(string(out))
		kind, control = "iblock", "udev_path="+l.loop
	}
	return tg.export(lun, n, l, kind, control)
}

// AddLUNOn exports the block device dev as LUN lun on every TPG (an
// iblock backstore) and returns the WWID the initiator will see. The
// device is the test's: made before the target, so that it goes after
// it (a dm-delay or dm-error map whose I/O the test holds back or fails).
func (tg *lioTarget) AddLUNOn(lun int, dev string) string {
	return tg.export(lun, lioSeq.Add(1), &lioLUN{}, "iblock", "udev_path="+dev)
}

// export makes backstore number n of kind with control, for l, and links
// it as LUN lun on every TPG.
func (tg *lioTarget) export(lun int, n int64, l *lioLUN, kind, control string) string {
	t := tg.t
	t.Helper()
	hba := filepath.Join(lioRoot, "core", fmt.Sprintf("%s_%d", kind, n))
	lioMkdir(t, hba)
	l.core = filepath.Join(hba, "disk")
	lioMkdir(t, l.core)
	lioWrite(t, filepath.Join(l.core, "control"), control)
	// The serial becomes the NAA WWID; it must be set before the LUN is
	// linked.
	// LIO builds the NAA WWID from the serial's first 25 hex digits:
	// the sequence number leads, so that every LUN has a WWID of its own.
	l.serial = fmt.Sprintf("%08d-b3e7-4a1c-8000-000000000000", n)
	lioWrite(t, filepath.Join(l.core, "wwn", "vpd_unit_serial"), l.serial)
	lioWrite(t, filepath.Join(l.core, "enable"), "1")
	for tpgt := range tg.tpgs {
		d := filepath.Join(tg.tpgDir(tpgt), "lun", "lun_"+strconv.Itoa(lun))
		lioMkdir(t, d)
		if err := os.Symlink(l.core, filepath.Join(d, "disk")); err != nil {
			t.Fatalf("LIO: link LUN: %v", err)
		}
	}
	tg.luns[lun] = l
	// LIO derives the NAA designator from the serial: 6001405 + the first
	// 25 hex digits of the serial with dashes removed.
	hex := strings.ReplaceAll(l.serial, "-", "")
	return "naa.6001405" + hex[:25]
}

// RemoveLUN unmaps a LUN from every TPG (the storage side deleted it).
func (tg *lioTarget) RemoveLUN(lun int) {
	for tpgt := range tg.tpgs {
		d := filepath.Join(tg.tpgDir(tpgt), "lun", "lun_"+strconv.Itoa(lun))
		os.Remove(filepath.Join(d, "disk"))
		if err := os.Remove(d); err != nil && !os.IsNotExist(err) {
			tg.t.Errorf("LIO: remove LUN %d: %v", lun, err)
		}
	}
}

// ReplaceLUN puts a new zeroed backstore of size bytes behind LUN number
// lun on every TPG, as an array does when a volume is deleted and its LUN
// number reused: the new LUN has another serial, so another WWID, which
// it returns.
func (tg *lioTarget) ReplaceLUN(lun int, size int64) string {
	tg.retired = append(tg.retired, tg.luns[lun])
	tg.RemoveLUN(lun)
	return tg.AddLUN(lun, size)
}

// BackingFile is the file behind LUN lun.
func (tg *lioTarget) BackingFile(lun int) string { return tg.luns[lun].file }

// PR reads attribute attr of the LUN's persistent-reservation state
// (pr/res_holder, res_pr_registered_i_pts, ...).
func (tg *lioTarget) PR(lun int, attr string) string {
	b, err := os.ReadFile(filepath.Join(tg.luns[lun].core, "pr", attr))
	if err != nil {
		tg.t.Errorf("LIO: read pr/%s: %v", attr, err)
	}
	return strings.TrimSpace(string(b))
}

// Grow enlarges a LUN's backing file and tells the loop device.
func (tg *lioTarget) Grow(lun int, size int64) {
	l := tg.luns[lun]
	if err := os.Truncate(l.file, size); err != nil {
		tg.t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", l.loop).CombinedOutput(); err != nil {
		tg.t.Fatalf("losetup -c: %v: %s", err, out)
	}
	l.size = size
}

// SetCHAP turns on CHAP for demo-mode sessions on every TPG.
func (tg *lioTarget) SetCHAP(user, pass, userIn, passIn string) {
	for tpgt := range tg.tpgs {
		d := tg.tpgDir(tpgt)
		lioWrite(tg.t, filepath.Join(d, "auth", "userid"), user)
		lioWrite(tg.t, filepath.Join(d, "auth", "password"), pass)
		if userIn != "" {
			lioWrite(tg.t, filepath.Join(d, "auth", "userid_mutual"), userIn)
			lioWrite(tg.t, filepath.Join(d, "auth", "password_mutual"), passIn)
		}
		lioWrite(tg.t, filepath.Join(d, "attrib", "authentication"), "1")
	}
}

// SetEnabled enables or disables one TPG (its portal): disabling drops its
// sessions and refuses new logins.
func (tg *lioTarget) SetEnabled(tpgt int, on bool) {
	v := "0"
	if on {
		v = "1"
	}
	lioWrite(tg.t, filepath.Join(tg.tpgDir(tpgt), "enable"), v)
}

// Vanish makes a TPG's portal stop answering: the listener goes first,
// then the sessions are dropped, so the initiator's reconnects are refused
// at the TCP level and it keeps retrying until the replacement timeout, as
// with a target that crashed or left the network. (A login refused by a
// live target would end recovery at once.)
func (tg *lioTarget) Vanish(tpgt int) {
	d := tg.tpgDir(tpgt)
	if err := os.Remove(filepath.Join(d, "np", tg.tpgs[tpgt])); err != nil {
		tg.t.Fatalf("LIO: remove portal: %v", err)
	}
	lioWrite(tg.t, filepath.Join(d, "enable"), "0")
}

// SetDiscoveryCHAP requires CHAP for SendTargets discovery (node-wide in
// LIO); empty user turns it off.
func (tg *lioTarget) SetDiscoveryCHAP(user, pass, userIn, passIn string) {
	d := filepath.Join(lioRoot, "iscsi", "discovery_auth")
	if user == "" {
		lioWrite(tg.t, filepath.Join(d, "enforce_discovery_auth"), "0")
		return
	}
	lioWrite(tg.t, filepath.Join(d, "userid"), user)
	lioWrite(tg.t, filepath.Join(d, "password"), pass)
	if userIn != "" {
		lioWrite(tg.t, filepath.Join(d, "userid_mutual"), userIn)
		lioWrite(tg.t, filepath.Join(d, "password_mutual"), passIn)
	}
	lioWrite(tg.t, filepath.Join(d, "enforce_discovery_auth"), "1")
	tg.t.Cleanup(func() { os.WriteFile(filepath.Join(d, "enforce_discovery_auth"), []byte("0"), 0o644) })
}

// Portal returns the portal of a TPG.
func (tg *lioTarget) Portal(tpgt int) string { return tg.tpgs[tpgt] }

// StartMultipathd is startMultipathd for the package's external tests.
func StartMultipathd(t *testing.T) { startMultipathd(t) }

// NewLIOTarget is newLIOTarget for the package's external tests.
func NewLIOTarget(t *testing.T, portals ...string) *lioTarget { return newLIOTarget(t, portals...) }

// Restore brings back a portal taken away by Vanish.
func (tg *lioTarget) Restore(tpgt int) {
	d := tg.tpgDir(tpgt)
	lioMkdir(tg.t, filepath.Join(d, "np", tg.tpgs[tpgt]))
	lioWrite(tg.t, filepath.Join(d, "enable"), "1")
}

// Destroy removes the target and frees its LUNs' backing files at once,
// before the test ends (a benchmark's many targets would fill the guest's
// tmpfs).
func (tg *lioTarget) Destroy() { tg.destroy() }

func (tg *lioTarget) destroy() {
	if tg.destroyed {
		return
	}
	tg.destroyed = true
	base := filepath.Join(lioRoot, "iscsi", tg.IQN)
	for tpgt, p := range tg.tpgs {
		d := tg.tpgDir(tpgt)
		os.WriteFile(filepath.Join(d, "enable"), []byte("0"), 0o644)
		for lun := range tg.luns {
			l := filepath.Join(d, "lun", "lun_"+strconv.Itoa(lun))
			os.Remove(filepath.Join(l, "disk"))
			os.Remove(l)
		}
		os.Remove(filepath.Join(d, "np", p))
		os.Remove(d)
	}
	os.Remove(base)
	luns := slices.Clone(tg.retired)
	for _, l := range tg.luns {
		luns = append(luns, l)
	}
	for _, l := range luns {
		os.Remove(l.core)
		os.Remove(filepath.Dir(l.core))
		if l.loop != "" {
			exec.Command("losetup", "-d", l.loop).Run()
		}
		if l.file != "" {
			os.Remove(l.file)
		}
	}
}
