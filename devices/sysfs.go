package devices

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs"
)

// Lookup reads the block device with the given kernel name from
// class/block of r.Sys. A name that does not exist gives an error
// wrapping errdefs.ErrNotFound.
func (r Roots) Lookup(name string) (*Device, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	return r.readDevice(r.block(name), "")
}

func checkName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("block device name %q: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// readDevice reads the device whose sysfs directory is sysPath. When kind is
// not empty and the device is of another kind, only its number, size and
// kind are read.
func (r Roots) readDevice(sysPath, kind string) (*Device, error) {
	return r.readDeviceEvent(sysPath, kind, nil)
}

// readDeviceEvent is readDevice for the device an event announced: the
// number, node name and type come from the event instead of sysfs (ev may
// be nil). Either way the device's "dev" attribute
// is read last and must still hold the number, so that a name reused while
// its attributes were read is not taken for the device.
func (r Roots) readDeviceEvent(sysPath, kind string, ev *Event) (*Device, error) {
	name := filepath.Base(sysPath)
	dir, err := sysfs.OpenDir(sysPath)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("block device %s: %w", name, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("block device %s: %w", name, err)
	}
	defer dir.Close()
	d := &Device{Name: name, sysPath: sysPath, Path: filepath.Join(r.dev(), name), roots: r}
	var env map[string]string
	if ev != nil && ev.HasDevNum && ev.Env != nil {
		env = ev.Env
		d.Major, d.Minor = ev.Major, ev.Minor
	} else {
		// The uevent attribute holds the number, node name, type and disk
		// sequence number in one read.
		if ue, err := dir.Read("uevent"); err == nil {
			env = parseUeventFile([]byte(ue))
		}
		maj, min, err := parseMajorMinor(env["MAJOR"] + ":" + env["MINOR"])
		if err != nil {
			devnum, err := dir.Read("dev")
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) {
					return nil, fmt.Errorf("block device %s: %w", name, errdefs.ErrNotFound)
				}
				return nil, fmt.Errorf("block device %s: %w", name, err)
			}
			if maj, min, err = parseMajorMinor(devnum); err != nil {
				return nil, fmt.Errorf("block device %s: %w", name, err)
			}
		}
		d.Major, d.Minor = maj, min
	}
	if n := strings.TrimPrefix(env["DEVNAME"], "/dev/"); n != "" && !strings.Contains(n, "..") && !strings.HasPrefix(n, "/") {
		d.Path = filepath.Join(r.dev(), n)
	}
	if s, err := dir.Read("size"); err == nil {
		if n, err := strconv.ParseInt(s, 10, 64); err == nil {
			d.Size = n * 512
		}
	}
	// An event's disk sequence number may be older than the medium the
	// attributes read now describe (a loop device re-attached since): only
	// the uevent attribute's is as current as they are.
	if s, ok := env["DISKSEQ"]; ok && ev == nil {
		d.DiskSeq, _ = strconv.ParseUint(s, 10, 64)
	} else if s, err := dir.Read("diskseq"); err == nil {
		d.DiskSeq, _ = strconv.ParseUint(s, 10, 64)
	}
	switch env["DEVTYPE"] {
	case "partition":
		return d, checkDevNum(dir, d) // partitions carry no identity of their own
	case "disk":
	default:
		if dir.Exists("partition") {
			return d, checkDevNum(dir, d)
		}
	}
	if s, _ := dir.Read("hidden"); s == "1" {
		return d, checkDevNum(dir, d) // NVMe per-path nodes behind a multipath head
	}
	d.ID.Kind = detectKind(dir, name, d)
	if kind != "" && d.ID.Kind != kind {
		return d, checkDevNum(dir, d)
	}
	switch d.ID.Kind {
	case KindLoop:
		d.ID.BackingFile, _ = dir.Read("loop/backing_file")
	case KindSCSI:
		readSCSIIdentity(dir, d)
	case KindNVMe:
		readNVMeIdentity(dir, d)
	case KindDM:
		d.ID.WWID, _ = dir.Read("dm/uuid")
		d.ID.DMName, _ = dir.Read("dm/name")
		// A map being created or reloaded is not usable yet.
		s, _ := dir.Read("dm/suspended")
		d.dmSuspended = s == "1"
	}
	return d, checkDevNum(dir, d)
}

// checkDevNum makes sure the device still has the number d was read with:
// it may have gone away, or its name been reused, while its attributes were
// read.
func checkDevNum(dir *sysfs.Dir, d *Device) error {
	s, err := dir.Read("dev")
	if err != nil {
		return fmt.Errorf("block device %s: removed while reading sysfs: %w", d.Name, errdefs.ErrNotFound)
	}
	maj, min, err := parseMajorMinor(s)
	if err != nil {
		return fmt.Errorf("block device %s: %w", d.Name, err)
	}
	if maj != d.Major || min != d.Minor {
		return fmt.Errorf("block device %s: is %d:%d, not %d:%d, after a removal: %w", d.Name, maj, min, d.Major, d.Minor, errdefs.ErrNotFound)
	}
	return nil
}

// loopMajor is the block major of loop devices (LOOP_MAJOR).
const loopMajor = 7

// detectKind tells the kind of device; for NVMe it keeps the subsystem NQN
// it read on the way.
func detectKind(dir *sysfs.Dir, name string, d *Device) string {
	switch {
	case strings.HasPrefix(name, "dm-") && dir.Exists("dm"):
		return KindDM
	case strings.HasPrefix(name, "loop") && d.Major == loopMajor:
		return KindLoop
	case strings.HasPrefix(name, "nvme"):
		// For a multipath head (/sys/devices/virtual/nvme-subsystem/
		// nvme-subsysN/nvmeXnY) "device" is the subsystem; for a namespace
		// without native multipath it is the controller. Both carry
		// subsysnqn.
		if nqn, err := dir.Read("device/subsysnqn"); err == nil {
			d.ID.NQN = nqn
			return KindNVMe
		}
	}
	if sub, err := dir.Readlink("device/subsystem"); err == nil && filepath.Base(sub) == "scsi" {
		return KindSCSI
	}
	return ""
}

func readSCSIIdentity(dir *sysfs.Dir, d *Device) {
	if target, err := dir.Readlink("device"); err == nil {
		d.ID.HCTL = filepath.Base(target)
	}
	d.ID.WWID, _ = dir.Read("device/wwid")
	if page, err := dir.ReadFile("device/vpd_pg83"); err == nil {
		if ds, err := ParseVPD83(page); err == nil {
			for _, x := range ds {
				if t := x.Text(); t != "" {
					d.designators = append(d.designators, t)
				}
			}
			if d.ID.WWID == "" {
				d.ID.WWID = PreferredWWID(ds)
			}
		}
	}
}

func readNVMeIdentity(dir *sysfs.Dir, d *Device) {
	if s, err := dir.Read("nsid"); err == nil {
		if n, err := strconv.ParseUint(s, 10, 32); err == nil {
			d.ID.NSID = uint32(n)
		}
	}
	uuid, _ := dir.Read("uuid")
	d.ID.UUID = strings.ToLower(uuid)
	if normHexID(uuid) == "" {
		d.ID.UUID = ""
	}
	nguid, _ := dir.Read("nguid")
	d.ID.NGUID = strings.ToLower(nguid)
	if normHexID(nguid) == "" {
		d.ID.NGUID = ""
	}
	d.ID.WWID, _ = dir.Read("wwid")
}

// readAttr reads a sysfs attribute without its trailing newline.
func readAttr(dir, attr string) (string, error) {
	return sysfs.ReadAttr(filepath.Join(dir, attr))
}

// parseUeventFile parses a sysfs uevent attribute (KEY=VALUE lines).
func parseUeventFile(b []byte) map[string]string {
	env := make(map[string]string)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			env[k] = v
		}
	}
	return env
}

// scanBlock reads every block device in sysfs and calls fn for it until fn
// returns true. Devices of another kind than kind (when not "") are passed
// without identity. When m can reject a device from one attribute (see
// prefilter) the others are not read at all: a scan over hundreds of loop
// devices then costs one read per device.
func (r Roots) scanBlock(kind string, m Matcher, fn func(*Device) bool) error {
	var names []string
	if nm, ok := m.(namedMatcher); ok && nm.deviceName() != "" {
		names = []string{nm.deviceName()}
	} else {
		var err error
		if names, err = r.Sys.List("class", "block"); err != nil {
			return fmt.Errorf("list block devices: %w", err)
		}
	}
	pf, _ := m.(prefilter)
	for _, name := range names {
		if kind != "" && !nameMayBeKind(name, kind) {
			continue
		}
		sysPath := r.block(name)
		if pf != nil && !pf.mayMatch(sysPath) {
			continue
		}
		d, err := r.readDevice(sysPath, kind)
		if err != nil {
			continue // removed meanwhile
		}
		if fn(d) {
			return nil
		}
	}
	return nil
}

// namedMatcher is implemented by matchers that, once deviceName is not
// empty, can only match the block device of that kernel name: a scan then
// reads that one device instead of every device on the node.
type namedMatcher interface {
	deviceName() string
}

// prefilter is implemented by matchers that can rule a device out from a
// single sysfs attribute, before the whole device is read.
type prefilter interface {
	mayMatch(sysPath string) bool
}

func (m loopMatcher) mayMatch(sysPath string) bool {
	f, err := readAttr(sysPath, "loop/backing_file")
	return err == nil && f == m.file
}

func (m nvmeMatcher) mayMatch(sysPath string) bool {
	nqn, err := readAttr(sysPath, "device/subsysnqn")
	return err == nil && nqn == m.nqn
}

func (m dmMatcher) mayMatch(sysPath string) bool {
	uuid, err := readAttr(sysPath, "dm/uuid")
	return err == nil && NormalizeWWID(uuid) == m.wwid
}

// nameMayBeKind skips devices by name where the kernel's naming settles it.
func nameMayBeKind(name, kind string) bool {
	switch kind {
	case KindLoop:
		return strings.HasPrefix(name, "loop")
	case KindDM:
		return strings.HasPrefix(name, "dm-")
	case KindNVMe:
		return strings.HasPrefix(name, "nvme")
	}
	return true
}

// udevInitialized reports whether udev's database has an entry for the
// device, which udevd writes when it has finished processing an event for it.
func (r Roots) udevInitialized(major, minor uint32) bool {
	_, err := os.Stat(filepath.Join(r.udevRun(), "data", fmt.Sprintf("b%d:%d", major, minor)))
	return err == nil
}

// Holders lists the kernel names of the devices stacked on name
// (class/block/<name>/holders of r.Sys), for example the dm map using a
// path.
func (r Roots) Holders(name string) ([]string, error) {
	return r.listDir(name, "holders")
}

// Slaves lists the kernel names of the devices name is stacked on
// (class/block/<name>/slaves of r.Sys), for example the paths of a dm
// map.
func (r Roots) Slaves(name string) ([]string, error) {
	return r.listDir(name, "slaves")
}

func (r Roots) listDir(name, sub string) ([]string, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	names, err := r.Sys.List("class", "block", name, sub)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("block device %s: %w", name, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("block device %s %s: %w", name, sub, err)
	}
	return names, nil
}
