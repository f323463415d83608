package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"

	"github.com/berth-csi/berth/devices"
)

// InventoryConfig says where Inventory looks.
type InventoryConfig struct {
	// StateDir is berth serve's state directory (its --state-dir).
	StateDir string
	// Transports parse the records' volume_context, so that each
	// volume's target reports its paths and health. A record of a
	// transport not given is reported without them.
	Transports []Transport
	// Roots are the trees devices are read from; the zero value is the
	// host's.
	Roots devices.Roots
	// MountInfo is the mount table read; "" is /proc/self/mountinfo.
	MountInfo string
}

// NodeInventory is what a node holds of berth's: each volume as its record
// says and as the kernel shows it, the records that cannot be read, and
// the loop devices berth attached that no record knows.
type NodeInventory struct {
	StateDir string            `json:"stateDir"`
	Volumes  []InventoryVolume `json:"volumes"`
	// UnreadableRecords are record files that do not parse (berth
	// keeps them, and refuses the volume's calls; see openStore).
	UnreadableRecords []InventoryRecordFile `json:"unreadableRecords"`
	// UnrecordedLoops are loop devices with berth's marker that no
	// readable record names.
	UnrecordedLoops []InventoryLoop `json:"unrecordedLoops"`
}

// Consistent reports whether the records and the kernel agree: every
// record readable and without problems, no loop device of berth's that
// no record knows.
func (inv *NodeInventory) Consistent() bool {
	for _, v := range inv.Volumes {
		if len(v.Problems) > 0 {
			return false
		}
	}
	return len(inv.UnreadableRecords) == 0 && len(inv.UnrecordedLoops) == 0
}

// InventoryVolume is one volume of the node.
type InventoryVolume struct {
	VolumeID  string `json:"volumeID"`
	Transport string `json:"transport"`
	// TargetKey is the record's target key (Target.Key): the image's
	// path, iqn and LUN, subsystem NQN and namespace.
	TargetKey string `json:"targetKey"`
	// TargetID is the storage's identity at stage (Target.Identity).
	TargetID   string `json:"targetID,omitempty"`
	AccessType string `json:"accessType"`
	FsType     string `json:"fsType,omitempty"`
	// Staged is false for a stage that did not complete.
	Staged     bool   `json:"staged"`
	RecordFile string `json:"recordFile"`
	// Device is the recorded block device, nil when the record has none.
	Device *InventoryDevice `json:"device"`
	// Mapping is the dm-crypt (LUKS2) mapping of an encrypted volume,
	// nil for one that is not encrypted.
	Mapping *InventoryDevice `json:"luksMapping,omitempty"`
	// Paths counts the target's paths to its storage by state ("live",
	// "failed", "missing", ...) as its transport tells them; nil for a
	// target without several paths or whose transport is not enabled.
	Paths      map[string]int `json:"paths,omitempty"`
	PathsError string         `json:"pathsError,omitempty"`
	Staging    InventoryMount `json:"staging"`
	// Publishes are the target paths the record names, by path.
	Publishes []InventoryMount `json:"publishes"`
	// OtherMounts are mount points of the volume's device that its
	// record does not name (made outside berth, or propagated).
	OtherMounts []string        `json:"otherMounts,omitempty"`
	Usage       *InventoryUsage `json:"usage,omitempty"`
	// Fencing is the volume's fencing at the target as recorded:
	// "reservation" (the node's key holds the reservation), "registrant"
	// (a multi-node writer: the key is registered), "none" (opted out:
	// unfenced), "unavailable" (the target has no reservations:
	// unfenced), or "" (none recorded: none applies, a node-local device
	// or a reader-only mode; or a volume staged by a berth that did not
	// fence, whose Message then says it is unfenced).
	Fencing string `json:"fencing,omitempty"`
	// Abnormal and Message are the volume condition NodeGetVolumeStats
	// would report.
	Abnormal bool   `json:"abnormal"`
	Message  string `json:"message"`
	// Problems are where the record and the kernel disagree.
	Problems []string `json:"problems,omitempty"`
}

// InventoryDevice is a recorded block device and what the kernel has
// under its name now.
type InventoryDevice struct {
	Name  string `json:"name"`
	Path  string `json:"path"`
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
	Kind  string `json:"kind,omitempty"`
	// Identity is what identifies the storage: the loop device's
	// backing file, a WWID, a namespace.
	Identity string `json:"identity,omitempty"`
	Size     int64  `json:"size"`
	// Present is set when the name is still the recorded device
	// (same number, disk sequence number and identity).
	Present bool `json:"present"`
}

// InventoryMount is a staging or publish path of a volume and what the
// mount table has there.
type InventoryMount struct {
	Path string `json:"path"`
	// ReadOnly is the publish's as recorded.
	ReadOnly bool `json:"readOnly,omitempty"`
	// Mounted is set when the mount table has a mount at the path;
	// Device ("major:minor") and FSType describe the one on top.
	Mounted bool   `json:"mounted"`
	Device  string `json:"device,omitempty"`
	FSType  string `json:"fsType,omitempty"`
	// ShowsVolume is set when the path shows the volume: the root of its
	// filesystem (a mount volume) or its device node (raw block).
	ShowsVolume bool `json:"showsVolume"`
}

// InventoryUsage is the statfs of a mount volume's staging mount, or the
// size of a raw block volume's device.
type InventoryUsage struct {
	TotalBytes     int64 `json:"totalBytes"`
	UsedBytes      int64 `json:"usedBytes,omitempty"`
	AvailableBytes int64 `json:"availableBytes,omitempty"`
	TotalInodes    int64 `json:"totalInodes,omitempty"`
	UsedInodes     int64 `json:"usedInodes,omitempty"`
}

// InventoryRecordFile is a record file that cannot be read.
type InventoryRecordFile struct {
	Path  string `json:"path"`
	Error string `json:"error"`
}

// InventoryLoop is a loop device berth attached that no record knows.
type InventoryLoop struct {
	Device string `json:"device"`
	Major  uint32 `json:"major"`
	Minor  uint32 `json:"minor"`
	// File is the path berth attached the image by; BackingFile is the
	// kernel's name of the file now.
	File        string   `json:"file"`
	BackingFile string   `json:"backingFile"`
	Mounts      []string `json:"mounts,omitempty"`
}

// Inventory reports what the node holds of berth's, from the records in
// cfg.StateDir and the kernel's view: sysfs, the mount table, statfs of
// the staging mounts and the transports' read-only Health and PathStates.
// It changes nothing: it does not take the state directory's lock (berth
// serve may run), removes no leftover temporary file and creates no
// directory or device node. A record written while it reads may be
// reported as it was before, or as unreadable.
func Inventory(ctx context.Context, cfg InventoryConfig) (*NodeInventory, error) {
	if cfg.StateDir == "" || !filepath.IsAbs(cfg.StateDir) {
		return nil, fmt.Errorf("state directory %q: want an absolute path", cfg.StateDir)
	}
	if fi, err := os.Stat(cfg.StateDir); err != nil {
		return nil, fmt.Errorf("state directory: %w (is it berth serve's --state-dir?)", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("state directory %s: not a directory", cfg.StateDir)
	}
	dir := filepath.Join(cfg.StateDir, "volumes")
	recs, damaged, err := readRecords(dir)
	if err != nil {
		return nil, err
	}
	mounts, err := readMountTable(cfg.MountInfo)
	if err != nil {
		return nil, err
	}
	loops, err := cfg.Roots.MarkedLoops()
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	a := &Agent{
		log:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		host:       newHostFS(),
		transports: make(map[string]Transport),
		lookup:     cfg.Roots.Lookup,
		pr:         kernelPR{},
	}
	for _, t := range cfg.Transports {
		a.transports[t.Name()] = t
	}
	inv := a.inventoryOf(ctx, recs, mounts, loops)
	inv.StateDir = cfg.StateDir
	for i := range inv.Volumes {
		inv.Volumes[i].RecordFile = filepath.Join(dir, stateFileName(inv.Volumes[i].VolumeID))
	}
	for _, p := range slices.Sorted(maps.Keys(damaged)) {
		inv.UnreadableRecords = append(inv.UnreadableRecords, InventoryRecordFile{Path: filepath.Join(dir, p), Error: damaged[p]})
	}
	return inv, nil
}

// readRecords reads every record in dir as openStore does, without
// changing anything: a missing directory is no record, a temporary file
// of a write in flight is skipped, and a record that does not parse, or
// that lies under another volume's file name, is returned in damaged
// (file name to why).
func readRecords(dir string) (recs []*volumeRecord, damaged map[string]string, err error) {
	damaged = make(map[string]string)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, damaged, nil
	} else if err != nil {
		return nil, nil, fmt.Errorf("read state directory: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".tmp-") || !strings.HasSuffix(name, ".json") {
			continue
		}
		r, err := readRecord(filepath.Join(dir, name))
		switch {
		case errors.Is(err, fs.ErrNotExist):
			// Removed since the directory was listed: unstaged.
		case err != nil:
			damaged[name] = err.Error()
		case stateFileName(r.VolumeID) != name:
			damaged[name] = fmt.Sprintf("holds volume %q, whose record belongs in %s", r.VolumeID, stateFileName(r.VolumeID))
		default:
			recs = append(recs, r)
		}
	}
	slices.SortFunc(recs, func(a, b *volumeRecord) int { return strings.Compare(a.VolumeID, b.VolumeID) })
	return recs, damaged, nil
}

// readMountTable reads the mount table at path ("" is the process's).
func readMountTable(path string) ([]*mountinfo.Info, error) {
	if path == "" {
		path = "/proc/self/mountinfo"
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	mounts, err := mountinfo.GetMountsFromReader(f, nil)
	if err != nil {
		return nil, fmt.Errorf("read mount table %s: %w", path, err)
	}
	return mounts, nil
}

// inventoryOf is Inventory for the records, mount table and loop devices
// already read.
func (a *Agent) inventoryOf(ctx context.Context, recs []*volumeRecord, mounts []*mountinfo.Info, loops []devices.MarkedLoop) *NodeInventory {
	inv := &NodeInventory{Volumes: []InventoryVolume{}, UnreadableRecords: []InventoryRecordFile{}, UnrecordedLoops: []InventoryLoop{}}
	for _, r := range recs {
		inv.Volumes = append(inv.Volumes, a.inventoryVolume(ctx, r, mounts))
	}
	for _, l := range loops {
		d := l.Device
		if recordedAnywhere(recs, d) {
			continue
		}
		il := InventoryLoop{Device: d.Path, Major: d.Major, Minor: d.Minor, File: l.File, BackingFile: d.ID.BackingFile}
		for _, m := range mounts {
			if uint32(m.Major) == d.Major && uint32(m.Minor) == d.Minor {
				il.Mounts = append(il.Mounts, m.Mountpoint)
			}
		}
		inv.UnrecordedLoops = append(inv.UnrecordedLoops, il)
	}
	slices.SortFunc(inv.UnrecordedLoops, func(a, b InventoryLoop) int { return int(a.Minor) - int(b.Minor) })
	return inv
}

// recordedAnywhere reports whether a record names the loop device d: as
// its device, or as the device it began to format.
func recordedAnywhere(recs []*volumeRecord, d *devices.Device) bool {
	for _, r := range recs {
		ds := []*deviceRecord{r.Device, r.Formatting}
		if r.Crypt != nil {
			ds = append(ds, r.Crypt.Formatting)
		}
		for _, rd := range ds {
			if rd != nil && rd.namesLoop(d) {
				return true
			}
		}
	}
	return false
}

// namesLoop reports whether the record is of the attach d is: the same
// number, and the same disk sequence number and backing file where both
// know them. A number alone is not enough: a loop device detached behind
// berth's back is soon given to another file.
func (r *deviceRecord) namesLoop(d *devices.Device) bool {
	if r.Major != d.Major || r.Minor != d.Minor {
		return false
	}
	if r.DiskSeq != 0 && d.DiskSeq != 0 && r.DiskSeq != d.DiskSeq {
		return false
	}
	ref, ok := d.LoopRef()
	return r.BackingIno == 0 || !ok || (r.BackingDev == ref.BackingDev && r.BackingIno == ref.BackingIno)
}

func (a *Agent) inventoryVolume(ctx context.Context, r *volumeRecord, mounts []*mountinfo.Info) InventoryVolume {
	v := InventoryVolume{
		VolumeID: r.VolumeID, Transport: r.Transport, TargetKey: r.TargetKey, TargetID: r.TargetID,
		AccessType: r.AccessType, FsType: r.FsType, Staged: r.Staged,
		Publishes: []InventoryMount{},
	}
	problem := func(format string, args ...any) { v.Problems = append(v.Problems, fmt.Sprintf(format, args...)) }
	t := a.recordedTarget(r)
	if _, ok := a.transports[r.Transport]; !ok {
		v.PathsError = fmt.Sprintf("transport %q is not enabled here: its paths and health are not looked at (give the flags berth serve has)", r.Transport)
	} else if t == nil {
		v.PathsError = "the recorded volume_context does not parse: its paths and health are not looked at"
	}

	var dev *devices.Device
	switch {
	case r.Device == nil:
		problem("no device is recorded: the stage did not get as far as attaching")
	default:
		v.Device, dev = a.inventoryDevice(r.Device)
		if dev == nil {
			problem("device %s (%d:%d) is gone, or its name is another device now", r.Device.Path, r.Device.Major, r.Device.Minor)
		}
		if !r.Staged {
			problem("the stage did not complete: the CO retries NodeStageVolume or calls NodeUnstageVolume")
		}
	}
	if r.Crypt != nil {
		if r.Crypt.Mapping == nil {
			v.Mapping = &InventoryDevice{Name: r.Crypt.Name}
			if r.Staged {
				problem("dm-crypt mapping %s is not recorded as open", r.Crypt.Name)
			}
		} else {
			var m *devices.Device
			v.Mapping, m = a.inventoryDevice(r.Crypt.Mapping)
			v.Mapping.Name = r.Crypt.Name
			if m == nil {
				problem("dm-crypt mapping %s (%d:%d) is gone, or its device is another now", r.Crypt.Name, r.Crypt.Mapping.Major, r.Crypt.Mapping.Minor)
			} else {
				dev = m
			}
		}
	}
	if r.Staged && t != nil {
		states, err := t.PathStates(ctx)
		if err != nil {
			v.PathsError = err.Error()
		} else {
			v.Paths = states
		}
	}

	// Staging and publish paths: the mount table's view, then whether
	// each shows the volume (the checks NodeGetVolumeStats makes).
	v.Staging = mountAtPath(mounts, r.StagingPath)
	if r.AccessType != "block" && r.Staged {
		u, err := a.pathCondition(r, r.StagingPath)
		switch {
		case err != nil:
			problem("check staging path: %v", err)
		case u != nil:
			problem("%s", u.Message)
		default:
			v.Staging.ShowsVolume = true
			if st, err := a.host.Stats(r.StagingPath); err != nil {
				problem("statfs of staging path: %v", err)
			} else {
				v.Usage = &InventoryUsage{TotalBytes: st.TotalBytes, UsedBytes: st.UsedBytes, AvailableBytes: st.AvailableBytes, TotalInodes: st.TotalInodes, UsedInodes: st.UsedInodes}
			}
		}
	}
	if r.AccessType == "block" && dev != nil {
		v.Usage = &InventoryUsage{TotalBytes: dev.Size}
	}
	targets := slices.Sorted(maps.Keys(r.Publishes))
	for _, p := range targets {
		m := mountAtPath(mounts, p)
		m.ReadOnly = r.Publishes[p].ReadOnly
		mounted, err := a.checkPublished(r, p)
		switch {
		case err != nil:
			problem("%v", err)
		case !mounted:
			problem("target path %s is not mounted", p)
		default:
			m.ShowsVolume = true
		}
		v.Publishes = append(v.Publishes, m)
	}
	for _, m := range mounts {
		_, published := r.Publishes[m.Mountpoint]
		if m.Mountpoint == r.StagingPath || published {
			continue
		}
		for _, d := range []*deviceRecord{r.Device, r.volumeDevice()} {
			if d != nil && uint32(m.Major) == d.Major && uint32(m.Minor) == d.Minor {
				v.OtherMounts = append(v.OtherMounts, m.Mountpoint)
				break
			}
		}
	}

	if r.Fence != nil {
		v.Fencing = r.Fence.Mode
	}
	c := a.conditionAt(ctx, r, t, targets)
	v.Abnormal, v.Message = c.Abnormal, c.Message
	return v
}

// inventoryDevice describes a recorded device and returns the device at
// its name when that is still the recorded one.
func (a *Agent) inventoryDevice(r *deviceRecord) (*InventoryDevice, *devices.Device) {
	d := &InventoryDevice{Name: r.Name, Path: r.Path, Major: r.Major, Minor: r.Minor, Kind: r.Kind, Size: r.Size, Identity: r.identity()}
	cur := a.recordedDevice(r)
	if cur != nil {
		d.Present, d.Size = true, cur.Size
	}
	return d, cur
}

// identity is what identifies a recorded device's storage, for people.
func (r *deviceRecord) identity() string {
	switch {
	case r.BackingFile != "":
		return r.BackingFile
	case r.NQN != "":
		return fmt.Sprintf("%s nsid %d", r.NQN, r.NSID)
	case r.WWID != "":
		return r.WWID
	case r.UUID != "":
		return r.UUID
	case r.DMName != "":
		return r.DMName
	}
	return ""
}

// mountAtPath is what the mount table has at p: the mount on top.
func mountAtPath(mounts []*mountinfo.Info, p string) InventoryMount {
	m := InventoryMount{Path: p}
	for _, e := range mounts {
		if e.Mountpoint == p {
			m.Mounted, m.Device, m.FSType = true, fmt.Sprintf("%d:%d", e.Major, e.Minor), e.FSType
		}
	}
	return m
}
