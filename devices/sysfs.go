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
)

// Roots of the kernel and udev trees; tests point them at fake trees under
// testdata.
var (
	sysfsRoot  = "/sys"
	devRoot    = "/dev"
	udevRunDir = "/run/udev"
)

// Lookup reads the block device with the given kernel name from
// /sys/class/block. A name that does not exist gives an error wrapping
// errdefs.ErrNotFound.
func Lookup(name string) (*Device, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	return readDevice(filepath.Join(sysfsRoot, "class", "block", name), "")
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
func readDevice(sysPath, kind string) (*Device, error) {
	name := filepath.Base(sysPath)
	devnum, err := readAttr(sysPath, "dev")
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("block device %s: %w", name, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("block device %s: %w", name, err)
	}
	d := &Device{Name: name, sysPath: sysPath}
	if d.Major, d.Minor, err = parseMajorMinor(devnum); err != nil {
		return nil, fmt.Errorf("block device %s: %w", name, err)
	}
	d.Path = filepath.Join(devRoot, name)
	if ue, err := os.ReadFile(filepath.Join(sysPath, "uevent")); err == nil {
		env := parseUeventFile(ue)
		if n := env["DEVNAME"]; n != "" && !strings.Contains(n, "..") {
			d.Path = filepath.Join(devRoot, n)
		}
	}
	if s, err := readAttr(sysPath, "size"); err == nil {
		if n, err := strconv.ParseInt(s, 10, 64); err == nil {
			d.Size = n * 512
		}
	}
	if s, err := readAttr(sysPath, "diskseq"); err == nil {
		d.DiskSeq, _ = strconv.ParseUint(s, 10, 64)
	}
	if exists(sysPath, "partition") {
		return d, nil // partitions carry no identity of their own
	}
	if s, _ := readAttr(sysPath, "hidden"); s == "1" {
		return d, nil // NVMe per-path nodes behind a multipath head
	}
	d.ID.Kind = detectKind(sysPath, name, d.Major)
	if kind != "" && d.ID.Kind != kind {
		return d, nil
	}
	switch d.ID.Kind {
	case KindLoop:
		d.ID.BackingFile, _ = readAttr(sysPath, "loop/backing_file")
	case KindSCSI:
		readSCSIIdentity(sysPath, d)
	case KindNVMe:
		readNVMeIdentity(sysPath, d)
	case KindDM:
		d.ID.WWID, _ = readAttr(sysPath, "dm/uuid")
		d.ID.DMName, _ = readAttr(sysPath, "dm/name")
		// A map being created or reloaded is not usable yet.
		s, _ := readAttr(sysPath, "dm/suspended")
		d.dmSuspended = s == "1"
	}
	// The device may have gone away while its attributes were read.
	if !exists(sysPath, "dev") {
		return nil, fmt.Errorf("block device %s: removed while reading sysfs: %w", name, errdefs.ErrNotFound)
	}
	return d, nil
}

// loopMajor is the block major of loop devices (LOOP_MAJOR).
const loopMajor = 7

func detectKind(sysPath, name string, major uint32) string {
	switch {
	case strings.HasPrefix(name, "dm-") && exists(sysPath, "dm"):
		return KindDM
	case strings.HasPrefix(name, "loop") && major == loopMajor:
		return KindLoop
	case strings.HasPrefix(name, "nvme") && exists(sysPath, "device/subsysnqn"):
		return KindNVMe
	}
	if sub, err := os.Readlink(filepath.Join(sysPath, "device", "subsystem")); err == nil && filepath.Base(sub) == "scsi" {
		return KindSCSI
	}
	return ""
}

func readSCSIIdentity(sysPath string, d *Device) {
	if target, err := os.Readlink(filepath.Join(sysPath, "device")); err == nil {
		d.ID.HCTL = filepath.Base(target)
	}
	d.ID.WWID, _ = readAttr(sysPath, "device/wwid")
	if page, err := os.ReadFile(filepath.Join(sysPath, "device", "vpd_pg83")); err == nil {
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

func readNVMeIdentity(sysPath string, d *Device) {
	// For a multipath head (/sys/devices/virtual/nvme-subsystem/nvme-subsysN/
	// nvmeXnY) "device" is the subsystem; for a namespace without native
	// multipath it is the controller. Both carry subsysnqn.
	d.ID.NQN, _ = readAttr(sysPath, "device/subsysnqn")
	if s, err := readAttr(sysPath, "nsid"); err == nil {
		if n, err := strconv.ParseUint(s, 10, 32); err == nil {
			d.ID.NSID = uint32(n)
		}
	}
	uuid, _ := readAttr(sysPath, "uuid")
	d.ID.UUID = strings.ToLower(uuid)
	if normHexID(uuid) == "" {
		d.ID.UUID = ""
	}
	nguid, _ := readAttr(sysPath, "nguid")
	d.ID.NGUID = strings.ToLower(nguid)
	if normHexID(nguid) == "" {
		d.ID.NGUID = ""
	}
	d.ID.WWID, _ = readAttr(sysPath, "wwid")
}

// readAttr reads a sysfs attribute without its trailing newline.
func readAttr(dir, attr string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, attr))
	if err != nil {
		return "", err
	}
	return string(bytes.TrimRight(b, "\n\x00 ")), nil
}

func exists(dir, attr string) bool {
	_, err := os.Lstat(filepath.Join(dir, attr))
	return err == nil
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
func scanBlock(kind string, m Matcher, fn func(*Device) bool) error {
	dir := filepath.Join(sysfsRoot, "class", "block")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("list block devices: %w", err)
	}
	pf, _ := m.(prefilter)
	for _, e := range ents {
		if kind != "" && !nameMayBeKind(e.Name(), kind) {
			continue
		}
		sysPath := filepath.Join(dir, e.Name())
		if pf != nil && !pf.mayMatch(sysPath) {
			continue
		}
		d, err := readDevice(sysPath, kind)
		if err != nil {
			continue // removed meanwhile
		}
		if fn(d) {
			return nil
		}
	}
	return nil
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

func (m scsiMatcher) mayMatch(sysPath string) bool {
	if m.hctl == "" {
		return true
	}
	target, err := os.Readlink(filepath.Join(sysPath, "device"))
	return err == nil && hctlHasPrefix(filepath.Base(target), m.hctl)
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
func udevInitialized(major, minor uint32) bool {
	_, err := os.Stat(filepath.Join(udevRunDir, "data", fmt.Sprintf("b%d:%d", major, minor)))
	return err == nil
}

// Holders lists the kernel names of the devices stacked on name
// (/sys/class/block/<name>/holders), for example the dm map using a path.
func Holders(name string) ([]string, error) {
	return listDir(name, "holders")
}

// Slaves lists the kernel names of the devices name is stacked on
// (/sys/class/block/<name>/slaves), for example the paths of a dm map.
func Slaves(name string) ([]string, error) {
	return listDir(name, "slaves")
}

func listDir(name, sub string) ([]string, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(filepath.Join(sysfsRoot, "class", "block", name, sub))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("block device %s: %w", name, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("block device %s %s: %w", name, sub, err)
	}
	out := make([]string, 0, len(ents))
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out, nil
}
