package target

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

const lioRoot = "/sys/kernel/config/target"

// ISCSILUN describes a LUN of an iSCSI target.
type ISCSILUN struct {
	Size   int64  // bytes (default 64 MiB)
	Serial string // wwn/vpd_unit_serial (hex digits; the SCSI WWID's NAA is derived from it); default stable
}

// CHAP holds CHAP credentials of an initiator ACL. Mutual* set: mutual CHAP.
// LIO wants secrets of 12 to 16 characters for most initiators.
type CHAP struct {
	User, Password             string
	MutualUser, MutualPassword string
}

// ISCSIInitiator is an ACL entry: an initiator IQN allowed to log in, with
// optional CHAP credentials. Every LUN of the target is mapped to it.
type ISCSIInitiator struct {
	IQN  string
	CHAP *CHAP
}

// ISCSIConfig describes an iSCSI target (one LIO target with TPG 1).
type ISCSIConfig struct {
	IQN     string     // default iqn.2003-01.io.berth:test-N
	Portals []string   // "ip:port"; default 127.0.0.1:3260
	LUNs    []ISCSILUN // default: one of 64 MiB
	// Initiators restricts access to these initiators (with CHAP if set).
	// Empty: demo mode, any initiator logs in without authentication.
	Initiators []ISCSIInitiator
}

// ISCSITarget is a LIO iSCSI target with iblock LUNs over loop devices.
// Each portal has a target portal group (TPG) of its own exporting the same
// LUNs, so one path can fail (SetPortalEnabled, RemovePortal) while the
// others keep their sessions, as with a multi-controller array.
type ISCSITarget struct {
	t    testing.TB
	cfg  ISCSIConfig
	dir  string // iscsi/<iqn>
	mu   sync.Mutex
	luns []*iscsiLUN
	tpgs map[string]string // portal -> TPG directory
	tag  int               // last TPG tag used
}

type iscsiLUN struct {
	ISCSILUN
	b       *backing
	hbaDir  string // core/iblock_N
	devDir  string // core/iblock_N/lunI
	lunName string // lun_I
}

// NewISCSITarget creates an iSCSI target through LIO configfs; it is removed
// when the test ends.
func NewISCSITarget(t testing.TB, cfg ISCSIConfig) *ISCSITarget {
	t.Helper()
	LoadModules(t, "target_core_mod", "target_core_iblock", "iscsi_target_mod")
	n := next("iscsi")
	if cfg.IQN == "" {
		cfg.IQN = fmt.Sprintf("iqn.2003-01.io.berth:test-%d", n)
	}
	if len(cfg.Portals) == 0 {
		cfg.Portals = []string{"127.0.0.1:3260"}
	}
	if len(cfg.LUNs) == 0 {
		cfg.LUNs = []ISCSILUN{{}}
	}
	x := &ISCSITarget{
		t: t, cfg: cfg,
		dir:  filepath.Join(lioRoot, "iscsi", cfg.IQN),
		tpgs: map[string]string{},
	}
	// LIO keeps the persistent reservations of APTPL registrations (the
	// kernel's sd asks for APTPL) under its dbroot's pr directory, which
	// it never creates: without it every REGISTER reports failure while
	// taking effect.
	if b, err := os.ReadFile(filepath.Join(lioRoot, "dbroot")); err == nil {
		if err := os.MkdirAll(filepath.Join(strings.TrimSpace(string(b)), "pr"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(filepath.Join(lioRoot, "iscsi")); os.IsNotExist(err) {
		mustMkdir(t, filepath.Join(lioRoot, "iscsi"))
	}
	mustMkdir(t, x.dir)
	t.Cleanup(x.remove)
	for i, l := range cfg.LUNs {
		x.addLUN(i, l)
	}
	for _, p := range cfg.Portals {
		x.AddPortal(p)
	}
	return x
}

func (x *ISCSITarget) addLUN(i int, l ISCSILUN) {
	t := x.t
	t.Helper()
	if l.Size == 0 {
		l.Size = 64 << 20
	}
	if l.Serial == "" {
		id := stableID("lun", x.cfg.IQN, strconv.Itoa(i))
		l.Serial = hex.EncodeToString(id[:12])
	}
	b := newBacking(t, l.Size)
	hba := filepath.Join(lioRoot, "core", fmt.Sprintf("iblock_%d", next("iblock")+100))
	lun := &iscsiLUN{ISCSILUN: l, b: b, hbaDir: hba, devDir: filepath.Join(hba, fmt.Sprintf("lun%d", i)),
		lunName: fmt.Sprintf("lun_%d", i)}
	x.mu.Lock()
	x.luns = append(x.luns, lun)
	x.mu.Unlock()
	x.makeDevice(lun)
}

// makeDevice creates the LUN's iblock device in configfs over its
// backing store.
func (x *ISCSITarget) makeDevice(lun *iscsiLUN) {
	t := x.t
	t.Helper()
	mustMkdir(t, lun.hbaDir)
	mustMkdir(t, lun.devDir)
	mustWrite(t, filepath.Join(lun.devDir, "control"), "udev_path="+lun.b.dev)
	mustWrite(t, filepath.Join(lun.devDir, "enable"), "1")
	// The unit serial must be set before the LUN is exported, or the
	// device has no stable WWID.
	mustWrite(t, filepath.Join(lun.devDir, "wwn", "vpd_unit_serial"), lun.Serial)
}

// addTPG creates and enables a TPG exporting every LUN on portal addr,
// with the next tag, or with tag when it is not 0.
func (x *ISCSITarget) addTPG(addr string, tag int) {
	t := x.t
	t.Helper()
	x.mu.Lock()
	if tag == 0 {
		x.tag++
		tag = x.tag
	}
	tpg := filepath.Join(x.dir, fmt.Sprintf("tpgt_%d", tag))
	x.tpgs[addr] = tpg
	luns := x.luns
	x.mu.Unlock()
	mustMkdir(t, tpg)
	for _, l := range luns {
		ld := filepath.Join(tpg, "lun", l.lunName)
		mustMkdir(t, ld)
		mustSymlink(t, l.devDir, filepath.Join(ld, "storage"))
	}
	attrib := filepath.Join(tpg, "attrib")
	if len(x.cfg.Initiators) == 0 {
		mustWrite(t, filepath.Join(attrib, "authentication"), "0")
		mustWrite(t, filepath.Join(attrib, "generate_node_acls"), "1")
		mustWrite(t, filepath.Join(attrib, "cache_dynamic_acls"), "1")
		mustWrite(t, filepath.Join(attrib, "demo_mode_write_protect"), "0")
	} else {
		mustWrite(t, filepath.Join(attrib, "generate_node_acls"), "0")
		auth := "0"
		for _, ini := range x.cfg.Initiators {
			x.addACL(tpg, ini)
			if ini.CHAP != nil {
				auth = "1"
			}
		}
		mustWrite(t, filepath.Join(attrib, "authentication"), auth)
	}
	mustMkdir(t, filepath.Join(tpg, "np", addr))
	mustWrite(t, filepath.Join(tpg, "enable"), "1")
}

func (x *ISCSITarget) addACL(tpg string, ini ISCSIInitiator) {
	t := x.t
	t.Helper()
	acl := filepath.Join(tpg, "acls", ini.IQN)
	mustMkdir(t, acl)
	for _, l := range x.luns {
		d := filepath.Join(acl, l.lunName)
		mustMkdir(t, d)
		mustSymlink(t, filepath.Join(tpg, "lun", l.lunName), filepath.Join(d, "map"))
	}
	if c := ini.CHAP; c != nil {
		auth := filepath.Join(acl, "auth")
		mustWrite(t, filepath.Join(auth, "userid"), c.User)
		mustWrite(t, filepath.Join(auth, "password"), c.Password)
		if c.MutualUser != "" {
			mustWrite(t, filepath.Join(auth, "userid_mutual"), c.MutualUser)
			mustWrite(t, filepath.Join(auth, "password_mutual"), c.MutualPassword)
		}
	}
}

// IQN is the target IQN.
func (x *ISCSITarget) IQN() string { return x.cfg.IQN }

// LUN returns LUN i with its effective serial and size.
func (x *ISCSITarget) LUN(i int) ISCSILUN {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.luns[i].ISCSILUN
}

// PR reads attribute attr of LUN i's persistent-reservation state in
// configfs (pr/res_holder, res_pr_type, res_pr_registered_i_pts,
// res_pr_generation).
func (x *ISCSITarget) PR(i int, attr string) string {
	x.mu.Lock()
	dir := x.luns[i].devDir
	x.mu.Unlock()
	b, err := os.ReadFile(filepath.Join(dir, "pr", attr))
	if err != nil {
		x.t.Errorf("read LUN %d's pr/%s: %v", i, attr, err)
	}
	return strings.TrimSpace(string(b))
}

// BackingDevice is the loop device behind LUN i.
func (x *ISCSITarget) BackingDevice(i int) string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.luns[i].b.dev
}

// APTPLFile is where LIO keeps LUN i's persistent reservations across a
// restart: dbroot/pr/aptpl_<unit serial>, written at every reservation
// change once a REGISTER asked for APTPL (Linux's sd always does).
func (x *ISCSITarget) APTPLFile(i int) string {
	b, err := os.ReadFile(filepath.Join(lioRoot, "dbroot"))
	if err != nil {
		x.t.Fatalf("LIO dbroot: %v", err)
	}
	return filepath.Join(strings.TrimSpace(string(b)), "pr", "aptpl_"+x.LUN(i).Serial)
}

// SessionInfo is LIO's view of initiator's session through portal (the
// ACL's info attribute: its ISID, TSIH and state), or the line saying it
// has none.
func (x *ISCSITarget) SessionInfo(portal, initiator string) string {
	x.t.Helper()
	b, err := os.ReadFile(filepath.Join(x.tpgOf(portal), "acls", initiator, "info"))
	if err != nil {
		x.t.Errorf("read the session info of %s on %s: %v", initiator, portal, err)
	}
	return strings.TrimSpace(string(b))
}

// TPGT is the tag of portal's target portal group.
func (x *ISCSITarget) TPGT(portal string) int {
	x.t.Helper()
	tag, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(x.tpgOf(portal)), "tpgt_"))
	if err != nil {
		x.t.Fatalf("TPG of %s: %v", portal, err)
	}
	return tag
}

// Restart restarts the target as a reboot of its host with a saved
// configuration does (targetcli's restoreconfig): every TPG and LUN
// leaves configfs, which ends the initiators' sessions (their commands
// wait in session recovery) and drops LIO's reservation state in
// memory; then each LUN comes back over the same backing store and
// serial, the reservations LIO saved for APTPL registrations
// (APTPLFile) are fed back through pr/res_aptpl_metadata before the LUN
// is exported, as targetcli does, and the TPGs come back with their tags,
// ACLs and portals. The initiators log in again by themselves, with the
// ISIDs the restored registrations name.
func (x *ISCSITarget) Restart() {
	t := x.t
	t.Helper()
	x.mu.Lock()
	tpgs := maps.Clone(x.tpgs)
	luns := x.luns
	x.mu.Unlock()
	for _, tpg := range tpgs {
		x.removeTPG(tpg)
	}
	for _, l := range luns {
		rmdir(t, l.devDir)
		rmdir(t, l.hbaDir)
	}
	for i, l := range luns {
		x.makeDevice(l)
		x.restoreAPTPL(i, l)
	}
	portals := slices.SortedFunc(maps.Keys(tpgs), func(a, b string) int { return strings.Compare(tpgs[a], tpgs[b]) })
	for _, p := range portals {
		tag, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(tpgs[p]), "tpgt_"))
		if err != nil {
			t.Fatalf("TPG of %s: %v", p, err)
		}
		x.addTPG(p, tag)
	}
}

// restoreAPTPL writes the registrations of LUN i's APTPL file into its
// pr/res_aptpl_metadata, one registration per write; LIO keeps them aside
// and makes them registrations again (the holder's with its reservation)
// when an ACL maps the LUN. A LUN without the file has nothing to restore.
func (x *ISCSITarget) restoreAPTPL(i int, l *iscsiLUN) {
	t := x.t
	t.Helper()
	b, err := os.ReadFile(x.APTPLFile(i))
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, reg := range aptplRegistrations(string(b)) {
		mustWrite(t, filepath.Join(l.devDir, "pr", "res_aptpl_metadata"), reg)
	}
}

// aptplRegistrations splits an APTPL file (PR_REG_START: n, key=value
// lines, PR_REG_END: n per registration) into the comma-separated
// key=value lists res_aptpl_metadata takes.
func aptplRegistrations(file string) []string {
	var regs, cur []string
	in := false
	for _, line := range strings.Split(file, "\n") {
		line = strings.TrimSpace(strings.TrimRight(line, "\x00"))
		switch {
		case strings.HasPrefix(line, "PR_REG_START:"):
			in, cur = true, nil
		case strings.HasPrefix(line, "PR_REG_END:"):
			if in && len(cur) > 0 {
				regs = append(regs, strings.Join(cur, ","))
			}
			in = false
		case in && strings.Contains(line, "="):
			cur = append(cur, line)
		}
	}
	return regs
}

// Portals lists the portals ("ip:port") of the target, sorted.
func (x *ISCSITarget) Portals() []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return slices.Sorted(maps.Keys(x.tpgs))
}

func (x *ISCSITarget) tpgOf(addr string) string {
	x.t.Helper()
	x.mu.Lock()
	defer x.mu.Unlock()
	tpg, ok := x.tpgs[addr]
	if !ok {
		x.t.Fatalf("iscsi target %s: no portal %s", x.cfg.IQN, addr)
	}
	return tpg
}

// AddPortal exports the target on addr ("ip:port") through a new TPG.
func (x *ISCSITarget) AddPortal(addr string) {
	t := x.t
	t.Helper()
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("iscsi target: portal %q: %v", addr, err)
	}
	x.mu.Lock()
	_, dup := x.tpgs[addr]
	x.mu.Unlock()
	if dup {
		t.Fatalf("iscsi target %s: portal %s exists", x.cfg.IQN, addr)
	}
	ensureLoopbackAlias(t, host)
	x.addTPG(addr, 0)
}

// RemovePortal removes the portal addr and its TPG: the sessions through it
// end (a path failure for the initiator).
func (x *ISCSITarget) RemovePortal(addr string) {
	x.t.Helper()
	tpg := x.tpgOf(addr)
	x.removeTPG(tpg)
	x.mu.Lock()
	delete(x.tpgs, addr)
	x.mu.Unlock()
}

// SetPortalEnabled disables (drops the sessions through addr and refuses new
// logins there) or re-enables one portal.
func (x *ISCSITarget) SetPortalEnabled(addr string, on bool) {
	x.t.Helper()
	mustWrite(x.t, filepath.Join(x.tpgOf(addr), "enable"), enableValue(on))
}

// SetEnabled disables or re-enables every portal: all paths fail or return.
func (x *ISCSITarget) SetEnabled(on bool) {
	x.t.Helper()
	for _, p := range x.Portals() {
		x.SetPortalEnabled(p, on)
	}
}

func enableValue(on bool) string {
	if on {
		return "1"
	}
	return "0"
}

// Grow enlarges LUN i to size bytes. The initiator sees the new size after a
// rescan (echo 1 > /sys/block/sdX/device/rescan).
func (x *ISCSITarget) Grow(i int, size int64) {
	x.t.Helper()
	x.mu.Lock()
	l := x.luns[i]
	x.mu.Unlock()
	if err := l.b.grow(size); err != nil {
		x.t.Fatalf("iscsi target %s: grow LUN %d: %v", x.cfg.IQN, i, err)
	}
	x.mu.Lock()
	l.Size = size
	x.mu.Unlock()
}

func (x *ISCSITarget) removeTPG(tpg string) {
	t := x.t
	if _, err := os.Stat(tpg); err != nil {
		return
	}
	writeAttr(filepath.Join(tpg, "enable"), "0")
	acls, _ := os.ReadDir(filepath.Join(tpg, "acls"))
	for _, a := range acls {
		ad := filepath.Join(tpg, "acls", a.Name())
		luns, _ := os.ReadDir(ad)
		for _, l := range luns {
			if strings.HasPrefix(l.Name(), "lun_") {
				unlinkAll(t, filepath.Join(ad, l.Name()))
				rmdir(t, filepath.Join(ad, l.Name()))
			}
		}
		rmdir(t, ad)
	}
	nps, _ := os.ReadDir(filepath.Join(tpg, "np"))
	for _, np := range nps {
		rmdir(t, filepath.Join(tpg, "np", np.Name()))
	}
	luns, _ := os.ReadDir(filepath.Join(tpg, "lun"))
	for _, l := range luns {
		unlinkAll(t, filepath.Join(tpg, "lun", l.Name()))
		rmdir(t, filepath.Join(tpg, "lun", l.Name()))
	}
	rmdir(t, tpg)
}

func (x *ISCSITarget) remove() {
	t := x.t
	x.mu.Lock()
	tpgs := make([]string, 0, len(x.tpgs))
	for _, tpg := range x.tpgs {
		tpgs = append(tpgs, tpg)
	}
	luns := x.luns
	x.mu.Unlock()
	for _, tpg := range tpgs {
		x.removeTPG(tpg)
	}
	rmdir(t, x.dir)
	for _, l := range luns {
		rmdir(t, l.devDir)
		rmdir(t, l.hbaDir)
	}
}

// InitiatorName is the guest's open-iscsi initiator IQN
// (/etc/iscsi/initiatorname.iscsi).
func InitiatorName(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("/etc/iscsi/initiatorname.iscsi")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "InitiatorName="); ok {
			return v
		}
	}
	t.Fatal("no InitiatorName in /etc/iscsi/initiatorname.iscsi")
	return ""
}
