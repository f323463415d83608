package devices

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Device kinds reported in Identity.Kind.
const (
	KindLoop = "loop"
	KindSCSI = "scsi"
	KindNVMe = "nvme"
	KindDM   = "dm"
)

// Identity is what makes a block device the one a volume asked for. It holds
// only comparable fields so that two reads can be compared with ==.
type Identity struct {
	Kind string // KindLoop, KindSCSI, KindNVMe, KindDM or "" for others
	// WWID is the SCSI unique device identifier as the kernel formats it
	// (device/wwid: "naa.…", "eui.…", "t10.…"), the namespace wwid for NVMe
	// and the map UUID ("mpath-3600…") for device-mapper.
	WWID string
	HCTL string // SCSI host:channel:target:lun

	NQN   string // NVMe subsystem NQN
	NSID  uint32 // NVMe namespace ID
	UUID  string // NVMe namespace UUID, "" when the target reports none
	NGUID string // NVMe namespace NGUID, "" when the target reports none

	BackingFile string // loop: the file as the kernel names it

	DMName string // device-mapper map name (multipath alias or WWID)
}

// Device is a block device found in sysfs.
type Device struct {
	Name         string // kernel name: "sdb", "nvme0n1", "loop3", "dm-2"
	Path         string // device node: "/dev/sdb"
	Major, Minor uint32
	Size         int64 // bytes
	// DiskSeq is the kernel's disk sequence number (0 when the kernel has
	// none). It changes whenever the name is given to a new medium, so a
	// loop device re-attached to another file, or a SCSI name reused for
	// another LUN, no longer verifies.
	DiskSeq uint64
	ID      Identity

	// designators holds every LUN designator of VPD page 0x83 in the
	// kernel's text form, so that a WWID given in another form still
	// matches.
	designators []string
	// sysPath is the sysfs directory the device was read from.
	sysPath string
	// roots are the trees the device was read from; what is done with it
	// later looks there again.
	roots Roots
	// dmSuspended: a device-mapper map without a live table.
	dmSuspended bool
	// backingDev and backingIno are, for a loop device that AttachLoop,
	// FindLoop or FindLoopRef returned, the device and inode numbers of
	// the file bound to it as LOOP_GET_STATUS64 reported them (zero for
	// a device read from sysfs only): see LoopRef.
	backingDev, backingIno uint64
}

// LoopRef names one attach of a loop device: the device's name and
// number, its disk sequence number and the device and inode numbers of
// the file bound to it (LOOP_GET_STATUS64 lo_device and lo_inode, which
// the kernel keeps from the bind on). It is what a caller records to find
// that attach again (FindLoopRef) whatever the file is called by then:
// renamed, deleted, or its name given to a symbolic link to another file.
type LoopRef struct {
	Name         string
	Major, Minor uint32
	// DiskSeq is compared when it is not 0: it changes at every bind.
	DiskSeq    uint64
	BackingDev uint64
	BackingIno uint64
}

// LoopRef returns the reference of a loop device whose backing file's
// numbers were read with it (see Device.backingIno); false for any other
// device.
func (d *Device) LoopRef() (LoopRef, bool) {
	if d == nil || d.ID.Kind != KindLoop || d.backingIno == 0 {
		return LoopRef{}, false
	}
	return LoopRef{Name: d.Name, Major: d.Major, Minor: d.Minor, DiskSeq: d.DiskSeq, BackingDev: d.backingDev, BackingIno: d.backingIno}, true
}

func (r LoopRef) String() string {
	return fmt.Sprintf("/dev/%s (%d:%d) bound to file %d:%d", r.Name, r.Major, r.Minor, r.BackingDev, r.BackingIno)
}

// Recorded is what a stage recorded about the device it attached, which
// its detach is given to compare the device it would remove with: the
// device's identity and, for a loop device, its attach (Loop; nil for
// another kind of device, or a record without the backing file's numbers).
type Recorded struct {
	ID   Identity
	Loop *LoopRef
}

func (d *Device) String() string {
	if d == nil {
		return "<nil>"
	}
	return fmt.Sprintf("%s (%d:%d)", d.Path, d.Major, d.Minor)
}

// Matcher selects the device a waiter is looking for.
type Matcher interface {
	Match(dev *Device) bool
	String() string
}

// kindMatcher is implemented by matchers that only ever match one kind of
// device; a sysfs scan skips reading the identity of the others.
type kindMatcher interface {
	kind() string
}

// MatchNVMe matches an NVMe namespace by subsystem NQN and namespace ID. A
// non-empty uuid or nguid must also be equal (case and dashes are ignored).
// nsid 0 matches any namespace ID, which is only useful together with a
// uuid or nguid.
func MatchNVMe(nqn string, nsid uint32, uuid, nguid string) Matcher {
	return nvmeMatcher{nqn: strings.TrimSpace(nqn), nsid: nsid, uuid: normHexID(uuid), nguid: normHexID(nguid)}
}

type nvmeMatcher struct {
	nqn         string
	nsid        uint32
	uuid, nguid string
}

func (m nvmeMatcher) kind() string { return KindNVMe }

func (m nvmeMatcher) Match(d *Device) bool {
	if d == nil || d.ID.Kind != KindNVMe || d.ID.NQN != m.nqn {
		return false
	}
	if m.nsid != 0 && d.ID.NSID != m.nsid {
		return false
	}
	if m.nsid == 0 && m.uuid == "" && m.nguid == "" {
		return false
	}
	if m.uuid != "" && normHexID(d.ID.UUID) != m.uuid {
		return false
	}
	if m.nguid != "" && normHexID(d.ID.NGUID) != m.nguid {
		return false
	}
	return true
}

func (m nvmeMatcher) String() string {
	s := fmt.Sprintf("NVMe namespace %d of %s", m.nsid, m.nqn)
	if m.uuid != "" {
		s += " with UUID " + m.uuid
	}
	if m.nguid != "" {
		s += " with NGUID " + m.nguid
	}
	return s
}

// normHexID folds a UUID or NGUID to lower case without dashes; an all-zero
// identifier (a target that reports none) becomes "".
func normHexID(s string) string {
	s = strings.ToLower(strings.ReplaceAll(strings.TrimSpace(s), "-", ""))
	if strings.Trim(s, "0") == "" {
		return ""
	}
	return s
}

// MatchSCSIAddress matches the SCSI disk at host:channel:target:lun. A
// negative target matches the LUN behind any target of the host's
// channel (an iSCSI session whose target id the kernel does not show).
func MatchSCSIAddress(host, channel, target, lun int) Matcher {
	return scsiAddrMatcher{host: host, channel: channel, target: target, lun: lun}
}

type scsiAddrMatcher struct{ host, channel, target, lun int }

func (m scsiAddrMatcher) kind() string { return KindSCSI }

func (m scsiAddrMatcher) Match(d *Device) bool {
	return d != nil && d.ID.Kind == KindSCSI && m.at(d.ID.HCTL)
}

// at reports whether hctl ("3:0:0:1") is the matcher's address.
func (m scsiAddrMatcher) at(hctl string) bool {
	f := strings.Split(hctl, ":")
	if len(f) != 4 {
		return false
	}
	var n [4]int
	for i, s := range f {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			return false
		}
		n[i] = v
	}
	return n[0] == m.host && n[1] == m.channel && (m.target < 0 || n[2] == m.target) && n[3] == m.lun
}

// mayMatch reads one link of the block device, its SCSI device
// (.../H:C:T:L), instead of the whole device: a node's other disks,
// hundreds of paths on a SAN node, are ruled out at that cost.
func (m scsiAddrMatcher) mayMatch(sysPath string) bool {
	target, err := os.Readlink(filepath.Join(sysPath, "device"))
	return err == nil && m.at(filepath.Base(target))
}

func (m scsiAddrMatcher) String() string {
	t := "*"
	if m.target >= 0 {
		t = strconv.Itoa(m.target)
	}
	return fmt.Sprintf("SCSI disk at %d:%d:%s:%d", m.host, m.channel, t, m.lun)
}

// loopMatcher matches the loop device whose backing file is file (a
// path canonicalFile returned: the kernel reports the resolved path).
type loopMatcher struct{ file string }

func (m loopMatcher) kind() string { return KindLoop }

func (m loopMatcher) Match(d *Device) bool {
	return d != nil && d.ID.Kind == KindLoop && m.file != "" && d.ID.BackingFile == m.file
}

func (m loopMatcher) String() string { return "loop device backed by " + m.file }

// canonicalFile returns the absolute path of file with symbolic links
// resolved as far as they exist.
func canonicalFile(file string) string {
	if file == "" {
		return ""
	}
	if abs, err := filepath.Abs(file); err == nil {
		file = abs
	}
	if real, err := filepath.EvalSymlinks(file); err == nil {
		file = real
	}
	return file
}

// MatchMultipath matches the device-mapper multipath map of the LUN with the
// given WWID (any form NormalizeWWID accepts). The map must have a table
// loaded and be resumed, and every device named in paths ("sdb", …) must be
// one of its paths: multipathd may first build a map over the paths it has
// and add the others by a reload, which sends another event.
func MatchMultipath(wwid string, paths ...string) Matcher {
	return dmMatcher{wwid: NormalizeWWID(wwid), paths: paths}
}

type dmMatcher struct {
	wwid  string
	paths []string
}

func (m dmMatcher) kind() string { return KindDM }

func (m dmMatcher) Match(d *Device) bool {
	if d == nil || d.ID.Kind != KindDM || m.wwid == "" || !strings.HasPrefix(d.ID.WWID, multipathUUIDPrefix) ||
		NormalizeWWID(d.ID.WWID) != m.wwid || d.Size <= 0 || d.dmSuspended {
		return false
	}
	if len(m.paths) == 0 {
		return true
	}
	slaves, err := d.roots.Slaves(d.Name)
	if err != nil {
		return false
	}
	for _, p := range m.paths {
		if !slices.Contains(slaves, p) {
			return false
		}
	}
	return true
}

func (m dmMatcher) String() string {
	if len(m.paths) > 0 {
		return fmt.Sprintf("multipath map of WWID %s over %s", m.wwid, strings.Join(m.paths, ", "))
	}
	return "multipath map of WWID " + m.wwid
}

const multipathUUIDPrefix = "mpath-"

// NormalizeWWID brings the forms a SCSI WWID is written in to the kernel's
// form so that they compare equal: "naa.6001405abc" (kernel), "36001405abc"
// (udev ID_SERIAL / multipath WWID), "mpath-36001405abc" (dm UUID),
// "0x6001405abc" and "wwn-0x6001405abc" (by-id links) all give
// "naa.6001405abc". Hex digits are folded to lower case; T10 vendor IDs keep
// their text with runs of spaces or underscores folded to one underscore.
func NormalizeWWID(s string) string {
	s = strings.TrimSpace(strings.TrimRight(s, "\x00"))
	s = strings.TrimPrefix(s, multipathUUIDPrefix)
	s = strings.TrimPrefix(s, "wwn-")
	if s == "" {
		return ""
	}
	lower := strings.ToLower(s)
	switch {
	case strings.HasPrefix(lower, "naa."), strings.HasPrefix(lower, "eui."):
		return lower
	case strings.HasPrefix(lower, "0x") && isHex(lower[2:]):
		return "naa." + lower[2:]
	case strings.HasPrefix(lower, "t10."):
		return "t10." + foldSpaces(s[4:])
	}
	// udev's scsi_id prefixes the identifier with the designator type.
	if len(s) > 1 {
		switch s[0] {
		case '3':
			if isHex(s[1:]) {
				return "naa." + lower[1:]
			}
		case '2':
			if isHex(s[1:]) {
				return "eui." + lower[1:]
			}
		case '1':
			return "t10." + foldSpaces(s[1:])
		case '8':
			return strings.ToLower(s[1:])
		}
	}
	if isHex(lower) && (len(lower) == 16 || len(lower) == 32) {
		return "naa." + lower
	}
	return lower
}

func foldSpaces(s string) string {
	f := strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == '_' })
	return strings.Join(f, "_")
}

func isHex(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return false
		}
	}
	return true
}

// parseMajorMinor parses "M:m" as found in sysfs dev files.
func parseMajorMinor(s string) (uint32, uint32, error) {
	maj, min, ok := strings.Cut(strings.TrimSpace(s), ":")
	if !ok {
		return 0, 0, fmt.Errorf("device number %q: want major:minor", s)
	}
	a, err := strconv.ParseUint(maj, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("device number %q: %w", s, err)
	}
	b, err := strconv.ParseUint(min, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("device number %q: %w", s, err)
	}
	return uint32(a), uint32(b), nil
}
