package devices

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Device-mapper ioctl interface (<linux/dm-ioctl.h>), version 4.
const (
	dmVersionMajor   = 4
	dmBufferFullFlag = 1 << 8
	dmStatusBufSize  = 16 << 10
	dmMaxBufSize     = 1 << 20
)

// dmControl is the device-mapper control node.
func (r Roots) dmControl() string { return filepath.Join(r.dev(), "mapper", "control") }

// dmIoctl issues one device-mapper ioctl on the map with the given device
// number. payload is placed after the header; the answer's header and data
// area are returned. A buffer the kernel found too small is grown.
func (r Roots) dmIoctl(req uint, major, minor uint32, flags uint32, payload []byte) (*unix.DmIoctl, []byte, error) {
	return r.dmIoctlOn(req, func(hdr *unix.DmIoctl) { hdr.Dev = unix.Mkdev(major, minor) }, flags, payload)
}

// dmIoctlOn is dmIoctl on the device that on names in the header: by
// number, or by name (a device without a table has no block device in
// sysfs, and no number to find it by there).
func (r Roots) dmIoctlOn(req uint, on func(*unix.DmIoctl), flags uint32, payload []byte) (*unix.DmIoctl, []byte, error) {
	ctl, err := os.OpenFile(r.dmControl(), os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open %s: %w (is dm_mod loaded?)", r.dmControl(), err)
	}
	defer ctl.Close()
	size := dmStatusBufSize
	for {
		if size < unix.SizeofDmIoctl+len(payload) {
			size = unix.SizeofDmIoctl + len(payload)
		}
		// uint64 backing keeps the header 8-byte aligned.
		words := make([]uint64, (size+7)/8)
		buf := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), len(words)*8)
		hdr := (*unix.DmIoctl)(unsafe.Pointer(&words[0]))
		hdr.Version = [3]uint32{dmVersionMajor, 0, 0}
		hdr.Data_size = uint32(len(buf))
		hdr.Data_start = unix.SizeofDmIoctl
		hdr.Flags = flags
		on(hdr)
		copy(buf[unix.SizeofDmIoctl:], payload)
		if err := ioctlPtr(ctl, req, &words[0]); err != nil {
			return nil, nil, err
		}
		if hdr.Flags&dmBufferFullFlag != 0 && size < dmMaxBufSize {
			size *= 4
			continue
		}
		out := *hdr
		end := min(int(hdr.Data_size), len(buf))
		start := min(int(hdr.Data_start), end)
		return &out, append([]byte(nil), buf[start:end]...), nil
	}
}

// dmTarget is one target line of a table status.
type dmTarget struct {
	start, length uint64
	typ           string
	params        string
}

// dmTableStatus returns the status of the live table's targets
// (DM_TABLE_STATUS, as `dmsetup status`), or with flags
// DM_STATUS_TABLE_FLAG their table lines (as `dmsetup table`).
func (r Roots) dmTableStatus(major, minor, flags uint32) (*unix.DmIoctl, []dmTarget, error) {
	hdr, data, err := r.dmIoctl(unix.DM_TABLE_STATUS, major, minor, flags, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("DM_TABLE_STATUS %d:%d: %w", major, minor, err)
	}
	var out []dmTarget
	off := 0
	for i := uint32(0); i < hdr.Target_count; i++ {
		if off+unix.SizeofDmTargetSpec > len(data) {
			return nil, nil, fmt.Errorf("DM_TABLE_STATUS %d:%d: target %d lies outside the answer", major, minor, i)
		}
		spec := (*unix.DmTargetSpec)(unsafe.Pointer(&data[off]))
		params := data[off+unix.SizeofDmTargetSpec:]
		if n := indexNUL(params); n >= 0 {
			params = params[:n]
		}
		out = append(out, dmTarget{
			start: spec.Sector_start, length: spec.Length,
			typ:    string(spec.Target_type[:max(0, indexNUL(spec.Target_type[:]))]),
			params: string(params),
		})
		if spec.Next == 0 {
			break
		}
		off += int(spec.Next)
	}
	return hdr, out, nil
}

func indexNUL(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return len(b)
}

// dmTargetMessage sends a message to the target at sector 0 of a map
// (DM_TARGET_MSG, as `dmsetup message`).
func (r Roots) dmTargetMessage(major, minor uint32, msg string) error {
	payload := make([]byte, 8+len(msg)+1) // struct dm_target_msg { __u64 sector; char message[]; }
	copy(payload[8:], msg)
	if _, _, err := r.dmIoctl(unix.DM_TARGET_MSG, major, minor, 0, payload); err != nil {
		return fmt.Errorf("DM_TARGET_MSG %d:%d %q: %w", major, minor, msg, err)
	}
	return nil
}

// dmRemove removes a map (DM_DEV_REMOVE). EBUSY means it is open.
func (r Roots) dmRemove(major, minor uint32) error {
	if _, _, err := r.dmIoctl(unix.DM_DEV_REMOVE, major, minor, 0, nil); err != nil {
		return fmt.Errorf("DM_DEV_REMOVE %d:%d: %w", major, minor, err)
	}
	return nil
}

// dmOpenCount returns how many times the map is open (DM_DEV_STATUS).
func (r Roots) dmOpenCount(major, minor uint32) (int, error) {
	hdr, _, err := r.dmIoctl(unix.DM_DEV_STATUS, major, minor, 0, nil)
	if err != nil {
		return 0, fmt.Errorf("DM_DEV_STATUS %d:%d: %w", major, minor, err)
	}
	return int(hdr.Open_count), nil
}

// MultipathPaths lists the paths of a dm-multipath map with the map's view
// of each (DM_TABLE_STATUS ioctl, no dmsetup or multipathd needed) and the
// SCSI state of the path device.
func MultipathPaths(dm *Device) ([]PathState, error) {
	if dm == nil || dm.ID.Kind != KindDM {
		return nil, fmt.Errorf("multipath paths: %v is not a device-mapper map: %w", dm, errdefs.ErrInvalidArgument)
	}
	_, targets, err := dm.roots.dmTableStatus(dm.Major, dm.Minor, 0)
	if err != nil {
		return nil, fmt.Errorf("multipath paths of %s: %w", dm.Path, err)
	}
	var out []PathState
	for _, t := range targets {
		if t.typ != "multipath" {
			return nil, fmt.Errorf("multipath paths of %s: target type %q, not multipath: %w", dm.Path, t.typ, errdefs.ErrInvalidArgument)
		}
		paths, err := parseMultipathStatus(t.params)
		if err != nil {
			return nil, fmt.Errorf("multipath paths of %s: %w", dm.Path, err)
		}
		for _, p := range paths {
			maj, min, _ := parseMajorMinor(p.dev)
			ps := PathState{Major: maj, Minor: min, Active: p.active, FailCount: p.failCount, Group: p.group, GroupState: p.groupState}
			if link, err := dm.roots.Sys.Readlink("dev", "block", p.dev); err == nil {
				ps.Name = filepath.Base(link)
				ps.SCSIState, _ = readAttr(dm.roots.block(ps.Name), "device/state")
			}
			out = append(out, ps)
		}
	}
	return out, nil
}

// SetQueueIfNoPath tells a dm-multipath map whether to queue I/O while
// none of its paths works (the "queue_if_no_path" and "fail_if_no_path"
// messages, as `dmsetup message <map> 0 ...` sends them). A map that fails
// I/O without a path lets an unmount or flush of it end with errors
// instead of waiting in the kernel for a path to come back. A map that no
// longer exists is not an error.
func SetQueueIfNoPath(dm *Device, queue bool) error {
	if dm == nil || dm.ID.Kind != KindDM || !strings.HasPrefix(dm.ID.WWID, multipathUUIDPrefix) {
		return fmt.Errorf("set queueing: %v is not a multipath map: %w", dm, errdefs.ErrInvalidArgument)
	}
	msg := "fail_if_no_path"
	if queue {
		msg = "queue_if_no_path"
	}
	if err := dm.roots.dmTargetMessage(dm.Major, dm.Minor, msg); err != nil && !errors.Is(err, unix.ENXIO) {
		return fmt.Errorf("multipath map %s (%s): %w", dm.ID.DMName, dm.Path, err)
	}
	return nil
}

// QueuesIfNoPath reports whether a dm-multipath map queues I/O while
// none of its paths works: its live table's features hold
// "queue_if_no_path" (as `dmsetup table` shows them).
func QueuesIfNoPath(dm *Device) (bool, error) {
	if dm == nil || dm.ID.Kind != KindDM || !strings.HasPrefix(dm.ID.WWID, multipathUUIDPrefix) {
		return false, fmt.Errorf("queueing: %v is not a multipath map: %w", dm, errdefs.ErrInvalidArgument)
	}
	_, targets, err := dm.roots.dmTableStatus(dm.Major, dm.Minor, unix.DM_STATUS_TABLE_FLAG)
	if err != nil {
		return false, fmt.Errorf("multipath map %s (%s): %w", dm.ID.DMName, dm.Path, err)
	}
	for _, t := range targets {
		if t.typ == "multipath" && slices.Contains(multipathFeatures(t.params), "queue_if_no_path") {
			return true, nil
		}
	}
	return false, nil
}

// InUse reports, as an error wrapping errdefs.ErrBusy, whether something
// holds the block device dev: a mounted filesystem, a device-mapper table
// or another exclusive opener. The kernel answers an exclusive open
// (O_EXCL) with EBUSY then, so this needs no mount table; only to name
// the holders is it read, filtered to the device's number. A plain open
// by a process is not seen. A device that is gone is not in use.
func InUse(dev *Device) error {
	if dev == nil || checkName(dev.Name) != nil {
		return fmt.Errorf("in use: %v is not a block device: %w", dev, errdefs.ErrInvalidArgument)
	}
	cur, same, err := current(dev)
	if err != nil || !same {
		return err
	}
	path := filepath.Join(dev.roots.dev(), cur.Name)
	err = openExclusive(path)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EBUSY) {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENXIO) || errors.Is(err, unix.ENODEV) {
			return nil
		}
		return fmt.Errorf("check whether %s is in use: %w", path, err)
	}
	return fmt.Errorf("%s is in use: %s: %w", dev.Path, holdersOf(cur), errdefs.ErrBusy)
}

// openExclusive opens path exclusively and closes it again
// (blockdev.Held): EBUSY when something holds it.
func openExclusive(path string) error {
	held, err := blockdev.Held(path)
	if held {
		return unix.EBUSY
	}
	return err
}

// holdersOf names what holds dev: the devices stacked on it, the mount
// points of its filesystem, or else an exclusive opener.
func holdersOf(dev *Device) string {
	var out []string
	if hs, _ := dev.roots.Holders(dev.Name); len(hs) > 0 {
		out = append(out, "held by "+strings.Join(hs, ", "))
	}
	mounts, _ := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
		return uint32(i.Major) != dev.Major || uint32(i.Minor) != dev.Minor, false
	})
	if len(mounts) > 0 {
		points := make([]string, len(mounts))
		for i, m := range mounts {
			points[i] = m.Mountpoint
		}
		out = append(out, "mounted at "+strings.Join(points, ", ")+" (a mount of the volume made outside berth, or propagated into another mount namespace: unmount it)")
	}
	if len(out) == 0 {
		return "held exclusively by a mount in another mount namespace or by a process (check `findmnt -N <pid>` of the other namespaces and `fuser -vm " + dev.Path + "`)"
	}
	return strings.Join(out, "; ")
}

// CheckDeviceMapper checks that the kernel's device-mapper answers on
// its control node: dm-crypt mappings (encrypted volumes) need it. A
// kernel without it (dm_mod not loaded, a container without the node)
// gives an error wrapping errdefs.ErrUnavailable.
func (r Roots) CheckDeviceMapper() error {
	ctl, err := os.OpenFile(r.dmControl(), os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) || errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("device-mapper: open %s: %w (load dm_mod and dm_crypt): %w", r.dmControl(), err, errdefs.ErrUnavailable)
		}
		return fmt.Errorf("device-mapper: open %s: %w", r.dmControl(), err)
	}
	return ctl.Close()
}

// RemoveUnloadedMap removes the device-mapper device named name when it
// has no table loaded and nobody has it open: what a `cryptsetup open`
// that did not finish between creating its device and loading the table
// (killed, or its table refused and the device not removed) leaves. Such
// a device maps nothing, so nothing can be lost by removing it, and
// while it exists no device of its name can be created. (It has no block
// device in sysfs yet: it is found by name through the control node.)
// owned says whether its device-mapper UUID is the caller's. It reports
// whether a device was removed; none of the name is no error. A device
// with a table, open, or not owned is left alone and reported as not
// removed.
func (r Roots) RemoveUnloadedMap(name string, owned func(uuid string) bool) (bool, error) {
	if name == "" || len(name) >= len(unix.DmIoctl{}.Name) {
		return false, fmt.Errorf("device-mapper name %q: %w", name, errdefs.ErrInvalidArgument)
	}
	byName := func(hdr *unix.DmIoctl) {
		copy(hdr.Name[:], name)
	}
	hdr, _, err := r.dmIoctlOn(unix.DM_DEV_STATUS, byName, 0, nil)
	if errors.Is(err, unix.ENXIO) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("DM_DEV_STATUS %s: %w", name, err)
	}
	uuid := unix.ByteSliceToString(hdr.Uuid[:])
	if !owned(uuid) || hdr.Flags&unix.DM_ACTIVE_PRESENT_FLAG != 0 || hdr.Open_count != 0 {
		return false, nil
	}
	// By number: a device created under the name meanwhile is another.
	major, minor := unix.Major(hdr.Dev), unix.Minor(hdr.Dev)
	if err := r.dmRemove(major, minor); err != nil && !errors.Is(err, unix.ENXIO) {
		return false, fmt.Errorf("remove device-mapper device %s (%d:%d) without a table: %w", name, major, minor, err)
	}
	return true, nil
}
