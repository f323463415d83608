package iscsi

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs"
)

// Session is an iSCSI session as the kernel shows it in sysfs:
//
//	/sys/class/iscsi_session/sessionN/{targetname,tpgt,ifacename,state,target_id}
//	/sys/class/iscsi_connection/connectionN:0/{persistent_address,persistent_port,address,port}
//	/sys/class/iscsi_session/sessionN -> .../hostH/sessionN/iscsi_session/sessionN
//	/sys/class/iscsi_session/sessionN/device/targetH:C:T/H:C:T:L
type Session struct {
	ID     int    // N of sessionN, the SID iscsiadm -r takes
	Target string // target name, lower case
	TPGT   int    // -1 when unknown
	Iface  string // open-iscsi interface name ("default")
	State  string // LOGGED_IN, FAILED, FREE
	// Host is the SCSI host number H the session's LUNs appear under.
	Host int
	// TargetID is the SCSI target id T, -1 when the kernel does not show it.
	TargetID int
	// PersistentAddress and PersistentPort are the portal iscsiadm logged
	// in to; Address and Port the current connection (after a redirect).
	PersistentAddress string
	PersistentPort    int
	Address           string
	Port              int
}

// HCTL is a SCSI address.
type HCTL struct{ Host, Channel, Target, LUN int }

func (h HCTL) String() string {
	return fmt.Sprintf("%d:%d:%d:%d", h.Host, h.Channel, h.Target, h.LUN)
}

var (
	sessionDirRE = regexp.MustCompile(`^session([0-9]+)$`)
	hostDirRE    = regexp.MustCompile(`^host([0-9]+)$`)
	targetDirRE  = regexp.MustCompile(`^target[0-9]+:[0-9]+:[0-9]+$`)
	hctlRE       = regexp.MustCompile(`^([0-9]+):([0-9]+):([0-9]+):([0-9]+)$`)
)

// sysTree reads the kernel's iSCSI and SCSI objects in a sysfs tree.
type sysTree struct{ root sysfs.Root }

// Sessions lists the iSCSI sessions of target (lower case), every session
// when target is empty. Another target's session costs one read (its
// target name): a SAN node may have hundreds. A session that disappears
// while it is read is skipped.
func (s sysTree) Sessions(target string) ([]Session, error) {
	names, err := s.root.List("class", "iscsi_session")
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil // scsi_transport_iscsi not loaded: no sessions
	}
	if err != nil {
		return nil, fmt.Errorf("list iSCSI sessions: %w", err)
	}
	var out []Session
	for _, name := range names {
		m := sessionDirRE.FindStringSubmatch(name)
		if m == nil {
			continue
		}
		id, _ := strconv.Atoi(m[1])
		sess, err := s.session(id, target)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if sess != nil {
			out = append(out, *sess)
		}
	}
	slices.SortFunc(out, func(a, b Session) int { return a.ID - b.ID })
	return out, nil
}

// Session reads one session; ErrNotFound when it does not exist.
func (s sysTree) Session(id int) (*Session, error) { return s.session(id, "") }

// session reads one session, or returns nil when it is not a session of
// target (unless target is empty).
func (s sysTree) session(id int, target string) (*Session, error) {
	name := "session" + strconv.Itoa(id)
	dir := s.root.Path("class", "iscsi_session", name)
	d, err := sysfs.OpenDir(dir)
	if sysfs.Gone(err) {
		return nil, fmt.Errorf("iSCSI %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("iSCSI %s: %w", name, err)
	}
	defer d.Close()
	tn, err := d.Read("targetname")
	if sysfs.Gone(err) {
		return nil, fmt.Errorf("iSCSI %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("iSCSI %s: %w", name, err)
	}
	tn = strings.ToLower(tn)
	if target != "" && tn != target {
		return nil, nil
	}
	sess := &Session{ID: id, Target: tn, TPGT: -1, TargetID: -1, Host: -1}
	// The class entry links to the session below its SCSI host:
	// ../../devices/platform/hostH/sessionN/iscsi_session/sessionN.
	real, err := os.Readlink(dir)
	if err != nil && !sysfs.Gone(err) { // not a link: a tree of real directories
		real, err = filepath.EvalSymlinks(dir)
	}
	if sysfs.Gone(err) {
		return nil, fmt.Errorf("iSCSI %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("iSCSI %s: %w", name, err)
	}
	for _, part := range strings.Split(real, string(filepath.Separator)) {
		if m := hostDirRE.FindStringSubmatch(part); m != nil {
			sess.Host, _ = strconv.Atoi(m[1])
		}
	}
	if sess.Host < 0 {
		return nil, fmt.Errorf("iSCSI %s: no SCSI host in its sysfs path %s", name, real)
	}
	if v, err := d.Read("tpgt"); err == nil {
		if n, err := strconv.Atoi(v); err == nil {
			sess.TPGT = n
		}
	}
	if v, err := d.Read("target_id"); err == nil {
		if n, err := strconv.Atoi(v); err == nil {
			sess.TargetID = n
		}
	}
	sess.Iface, _ = d.Read("ifacename")
	if sess.Iface == "" || sess.Iface == "<NULL>" || sess.Iface == "(null)" {
		sess.Iface = "default"
	}
	sess.State, _ = d.Read("state")

	if c, err := s.root.OpenDir("class", "iscsi_connection", "connection"+strconv.Itoa(id)+":0"); err == nil {
		sess.PersistentAddress, _ = c.Read("persistent_address")
		sess.Address, _ = c.Read("address")
		if v, err := c.Read("persistent_port"); err == nil {
			sess.PersistentPort, _ = strconv.Atoi(v)
		}
		if v, err := c.Read("port"); err == nil {
			sess.Port, _ = strconv.Atoi(v)
		}
		c.Close()
	}
	sess.PersistentAddress = canonicalIP(sess.PersistentAddress)
	sess.Address = canonicalIP(sess.Address)
	return sess, nil
}

func canonicalIP(s string) string {
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap().WithZone("").String()
	}
	return strings.ToLower(s)
}

// Matches reports whether the session is the login of target through the
// portal ip:port on iface. The persistent address is the one iscsiadm
// logged in to; the current address is accepted too, for targets that
// redirect.
func (s *Session) Matches(target, ip string, port int, iface string) bool {
	if s.Target != target || s.Iface != iface {
		return false
	}
	ip = canonicalIP(ip)
	return (s.PersistentAddress == ip && s.PersistentPort == port) || (s.Address == ip && s.Port == port)
}

// LUNs returns the SCSI devices the session has: the H:C:T:L entries below
// its target directories.
func (s sysTree) LUNs(id int) ([]HCTL, error) {
	dev := []string{"class", "iscsi_session", "session" + strconv.Itoa(id), "device"}
	targets, err := s.root.List(dev...)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list LUNs of iSCSI session%d: %w", id, err)
	}
	var out []HCTL
	for _, t := range targets {
		if !targetDirRE.MatchString(t) {
			continue
		}
		names, err := s.root.List(append(dev, t)...)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("list LUNs of iSCSI session%d: %w", id, err)
		}
		for _, name := range names {
			if h, ok := parseHCTL(name); ok {
				out = append(out, h)
			}
		}
	}
	slices.SortFunc(out, func(a, b HCTL) int { return a.LUN - b.LUN })
	return out, nil
}

func parseHCTL(s string) (HCTL, bool) {
	m := hctlRE.FindStringSubmatch(s)
	if m == nil {
		return HCTL{}, false
	}
	var n [4]int
	for i := range n {
		v, err := strconv.Atoi(m[i+1])
		if err != nil {
			return HCTL{}, false
		}
		n[i] = v
	}
	return HCTL{n[0], n[1], n[2], n[3]}, true
}

// BlockDevice returns the kernel name ("sdb") of the disk at h, or
// ErrNotFound while it has none.
func (s sysTree) BlockDevice(h HCTL) (string, error) {
	names, err := s.root.List("class", "scsi_device", h.String(), "device", "block")
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("SCSI device %s has no block device: %w", h, errdefs.ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("SCSI device %s: %w", h, err)
	}
	for _, name := range names {
		return name, nil
	}
	return "", fmt.Errorf("SCSI device %s has no block device: %w", h, errdefs.ErrNotFound)
}

// lunDir is the sysfs directory of one SCSI device, opened once and
// checked to be a LUN of a given iSCSI session. Reads and writes go
// through the descriptor: a device removed meanwhile answers ENOENT or
// ENODEV there, even when a new device took its H:C:T:L.
type lunDir struct {
	f  *os.File
	at string // /proc/self/fd/N
}

// openLUN opens the SCSI device at h if it is a LUN of session id, and
// ErrNotFound when there is none or h now names another session's LUN:
// the device's real sysfs path runs through the session's directory
// (.../hostN/sessionID/targetN:C:T/N:C:T:L).
func (s sysTree) openLUN(id int, h HCTL) (*lunDir, error) {
	f, err := os.Open(s.root.Path("class", "scsi_device", h.String(), "device"))
	if sysfs.Gone(err) {
		return nil, fmt.Errorf("SCSI device %s: %w", h, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("SCSI device %s: %w", h, err)
	}
	d := &lunDir{f: f, at: fmt.Sprintf("/proc/self/fd/%d", f.Fd())}
	real, err := os.Readlink(d.at)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("SCSI device %s: %w", h, err)
	}
	if !slices.Contains(strings.Split(real, string(filepath.Separator)), "session"+strconv.Itoa(id)) {
		f.Close()
		return nil, fmt.Errorf("SCSI device %s is not a LUN of session %d (%s): %w", h, id, real, errdefs.ErrNotFound)
	}
	return d, nil
}

func (d *lunDir) Close() error { return d.f.Close() }

// state reads the device's state ("running", "offline", "blocked", ...).
func (d *lunDir) state() string {
	v, _ := sysfs.ReadAttr(filepath.Join(d.at, "state"))
	return v
}

// offline sets the device offline, so that the I/O its removal issues
// (SYNCHRONIZE CACHE) fails at once instead of waiting for a dead target.
func (d *lunDir) offline() error { return writeAttr(filepath.Join(d.at, "state"), "offline") }

// delete deletes the device from the kernel; one already gone is success.
func (d *lunDir) delete() error {
	err := writeAttr(filepath.Join(d.at, "delete"), "1")
	if sysfs.Gone(err) {
		return nil
	}
	return err
}

// blockDevice returns the kernel name of the device's disk ("sdb"), or
// ErrNotFound while it has none.
func (d *lunDir) blockDevice() (string, error) {
	ents, err := os.ReadDir(filepath.Join(d.at, "block"))
	if sysfs.Gone(err) {
		return "", errdefs.ErrNotFound
	}
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		return e.Name(), nil
	}
	return "", errdefs.ErrNotFound
}

// SCSIDeviceState reads device/state ("running", "offline", "blocked",
// "transport-offline").
func (s sysTree) SCSIDeviceState(h HCTL) string {
	v, _ := s.root.ReadAttr("class", "scsi_device", h.String(), "device", "state")
	return v
}

// Scan asks the kernel to probe exactly one LUN of the session's target:
// "C T L" written to the host's scan attribute. The write returns when the
// probe is over; the block device follows through a uevent.
func (s sysTree) Scan(sess *Session, lun int) error {
	t := "-"
	if sess.TargetID >= 0 {
		t = strconv.Itoa(sess.TargetID)
	}
	return writeAttr(s.root.Path("class", "scsi_host", "host"+strconv.Itoa(sess.Host), "scan"), fmt.Sprintf("0 %s %d", t, lun))
}

// Rescan makes the kernel re-read the capacity and the identification
// (VPD pages, so the WWID) of a disk.
func (s sysTree) Rescan(h HCTL) error {
	return writeAttr(s.root.Path("class", "scsi_device", h.String(), "device", "rescan"), "1")
}

func writeAttr(path, v string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", v, path, err)
	}
	_, err = f.WriteString(v)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", v, path, err)
	}
	return nil
}
