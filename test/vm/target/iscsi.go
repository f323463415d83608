package target

import (
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
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
type ISCSITarget struct {
	t       testing.TB
	cfg     ISCSIConfig
	tpg     string
	mu      sync.Mutex
	luns    []*iscsiLUN
	portals map[string]bool
}

type iscsiLUN struct {
	ISCSILUN
	b       *backing
	hbaDir  string // core/iblock_N
	devDir  string // core/iblock_N/lunname
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
		tpg:     filepath.Join(lioRoot, "iscsi", cfg.IQN, "tpgt_1"),
		portals: map[string]bool{},
	}
	if _, err := os.Stat(filepath.Join(lioRoot, "iscsi")); os.IsNotExist(err) {
		mustMkdir(t, filepath.Join(lioRoot, "iscsi"))
	}
	mustMkdir(t, filepath.Dir(x.tpg))
	t.Cleanup(x.remove)
	mustMkdir(t, x.tpg)

	for i, l := range cfg.LUNs {
		x.addLUN(i, l)
	}
	attrib := filepath.Join(x.tpg, "attrib")
	if len(cfg.Initiators) == 0 {
		mustWrite(t, filepath.Join(attrib, "authentication"), "0")
		mustWrite(t, filepath.Join(attrib, "generate_node_acls"), "1")
		mustWrite(t, filepath.Join(attrib, "cache_dynamic_acls"), "1")
		mustWrite(t, filepath.Join(attrib, "demo_mode_write_protect"), "0")
	} else {
		mustWrite(t, filepath.Join(attrib, "generate_node_acls"), "0")
		auth := false
		for _, ini := range cfg.Initiators {
			x.addACL(ini)
			auth = auth || ini.CHAP != nil
		}
		if auth {
			mustWrite(t, filepath.Join(attrib, "authentication"), "1")
		} else {
			mustWrite(t, filepath.Join(attrib, "authentication"), "0")
		}
	}
	for _, p := range cfg.Portals {
		x.AddPortal(p)
	}
	mustWrite(t, filepath.Join(x.tpg, "enable"), "1")
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
	mustMkdir(t, hba)
	lun := &iscsiLUN{ISCSILUN: l, b: b, hbaDir: hba, devDir: filepath.Join(hba, fmt.Sprintf("lun%d", i)),
		lunName: fmt.Sprintf("lun_%d", i)}
	x.mu.Lock()
	x.luns = append(x.luns, lun)
	x.mu.Unlock()
	mustMkdir(t, lun.devDir)
	mustWrite(t, filepath.Join(lun.devDir, "control"), "udev_path="+b.dev)
	mustWrite(t, filepath.Join(lun.devDir, "enable"), "1")
	// The unit serial must be set before the LUN is exported, or the
	// device has no stable WWID.
	mustWrite(t, filepath.Join(lun.devDir, "wwn", "vpd_unit_serial"), l.Serial)
	ld := filepath.Join(x.tpg, "lun", lun.lunName)
	mustMkdir(t, ld)
	mustSymlink(t, lun.devDir, filepath.Join(ld, "storage"))
}

func (x *ISCSITarget) addACL(ini ISCSIInitiator) {
	t := x.t
	t.Helper()
	acl := filepath.Join(x.tpg, "acls", ini.IQN)
	mustMkdir(t, acl)
	for _, l := range x.luns {
		d := filepath.Join(acl, l.lunName)
		mustMkdir(t, d)
		mustSymlink(t, filepath.Join(x.tpg, "lun", l.lunName), filepath.Join(d, "map"))
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

// BackingDevice is the loop device behind LUN i.
func (x *ISCSITarget) BackingDevice(i int) string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.luns[i].b.dev
}

// Portals lists the portals ("ip:port") of the target, sorted.
func (x *ISCSITarget) Portals() []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	var ps []string
	for p := range x.portals {
		ps = append(ps, p)
	}
	sort.Strings(ps)
	return ps
}

// AddPortal makes the target listen on addr ("ip:port").
func (x *ISCSITarget) AddPortal(addr string) {
	t := x.t
	t.Helper()
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("iscsi target: portal %q: %v", addr, err)
	}
	ensureLoopbackAlias(t, host)
	mustMkdir(t, filepath.Join(x.tpg, "np", addr))
	x.mu.Lock()
	x.portals[addr] = true
	x.mu.Unlock()
}

// RemovePortal stops listening on addr and drops the sessions through it
// (a path failure for the initiator).
func (x *ISCSITarget) RemovePortal(addr string) {
	x.t.Helper()
	if err := os.Remove(filepath.Join(x.tpg, "np", addr)); err != nil {
		x.t.Fatalf("iscsi target %s: remove portal %s: %v", x.cfg.IQN, addr, err)
	}
	x.mu.Lock()
	delete(x.portals, addr)
	x.mu.Unlock()
}

// SetEnabled enables or disables the target portal group; disabling it
// drops every session (all paths fail), enabling it lets initiators back in.
func (x *ISCSITarget) SetEnabled(on bool) {
	x.t.Helper()
	v := "0"
	if on {
		v = "1"
	}
	mustWrite(x.t, filepath.Join(x.tpg, "enable"), v)
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

func (x *ISCSITarget) remove() {
	t := x.t
	if _, err := os.Stat(x.tpg); err == nil {
		writeAttr(filepath.Join(x.tpg, "enable"), "0")
		acls, _ := os.ReadDir(filepath.Join(x.tpg, "acls"))
		for _, a := range acls {
			ad := filepath.Join(x.tpg, "acls", a.Name())
			luns, _ := os.ReadDir(ad)
			for _, l := range luns {
				if strings.HasPrefix(l.Name(), "lun_") {
					unlinkAll(t, filepath.Join(ad, l.Name()))
					rmdir(t, filepath.Join(ad, l.Name()))
				}
			}
			rmdir(t, ad)
		}
		nps, _ := os.ReadDir(filepath.Join(x.tpg, "np"))
		for _, np := range nps {
			rmdir(t, filepath.Join(x.tpg, "np", np.Name()))
		}
		luns, _ := os.ReadDir(filepath.Join(x.tpg, "lun"))
		for _, l := range luns {
			unlinkAll(t, filepath.Join(x.tpg, "lun", l.Name()))
			rmdir(t, filepath.Join(x.tpg, "lun", l.Name()))
		}
		rmdir(t, x.tpg)
	}
	rmdir(t, filepath.Dir(x.tpg))
	x.mu.Lock()
	luns := x.luns
	x.mu.Unlock()
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
