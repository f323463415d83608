package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// pathsTransport is a network transport as Inventory sees it: targets
// that report their paths and health, as iSCSI sessions and NVMe
// controllers would, without a node to attach anything on.
type pathsTransport struct {
	name   string
	states map[string]map[string]int // by target key
	health map[string]string         // abnormal message by target key
}

func (p *pathsTransport) Name() string   { return p.name }
func (p *pathsTransport) Keys() []string { return nil }
func (p *pathsTransport) Parse(vc, _ map[string]string) (Target, error) {
	return &pathsTarget{fakeTarget: fakeTarget{key: vc["key"]}, tr: p}, nil
}

type pathsTarget struct {
	fakeTarget
	tr *pathsTransport
}

func (t *pathsTarget) PathStates(context.Context) (map[string]int, error) {
	s, ok := t.tr.states[t.key]
	if !ok {
		return nil, errors.New("no session of the target")
	}
	return s, nil
}

func (t *pathsTarget) Health(context.Context) (bool, string) {
	if msg, ok := t.tr.health[t.key]; ok {
		return true, msg
	}
	return false, ""
}

// Inventory of network volumes, from records, a device tree and a mount
// table made up here: the target's path states and health, a LUKS
// mapping gone, a path state that cannot be read, a mount of a volume's
// device elsewhere, and a loop device no record names.
func TestInventoryNetworkVolumes(t *testing.T) {
	sdb := &devices.Device{Name: "sdb", Path: "/dev/sdb", Major: 8, Minor: 16, Size: 1 << 30, ID: devices.Identity{Kind: devices.KindSCSI, WWID: "naa.600140512345678"}}
	nvme := &devices.Device{Name: "nvme1n1", Path: "/dev/nvme1n1", Major: 259, Minor: 3, Size: 2 << 30, ID: devices.Identity{Kind: devices.KindNVMe, NQN: "nqn.2014-08.org.example:sub", NSID: 1}}
	sdc := &devices.Device{Name: "sdc", Path: "/dev/sdc", Major: 8, Minor: 32, Size: 1 << 30, ID: devices.Identity{Kind: devices.KindSCSI, WWID: "naa.600140599999999"}}
	present := map[string]*devices.Device{"sdb": sdb, "nvme1n1": nvme, "sdc": sdc}
	a := &Agent{
		log:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		host: newFakeFS(),
		lookup: func(name string) (*devices.Device, error) {
			if d, ok := present[name]; ok {
				return d, nil
			}
			return nil, fmt.Errorf("block device %s: %w", name, errdefs.ErrNotFound)
		},
		transports: map[string]Transport{},
	}
	iscsiT := &pathsTransport{name: "iscsi",
		states: map[string]map[string]int{"iqn.2003-01.org.example:t/0": {"live": 1, "failed": 1}},
		health: map[string]string{"iqn.2003-01.org.example:t/0": "portal 10.0.0.2:3260: session 4 is FAILED"}}
	nvmeT := &pathsTransport{name: "nvmeof", states: map[string]map[string]int{"nqn.2014-08.org.example:sub/1": {"live": 2}}}
	a.transports["iscsi"], a.transports["nvmeof"] = iscsiT, nvmeT

	dm := &deviceRecord{Name: "dm-3", Path: "/dev/dm-3", Major: 253, Minor: 3, Kind: devices.KindDM, DMName: "berth-vol-luks"}
	recs := []*volumeRecord{
		{VolumeID: "vol-iscsi", Transport: "iscsi", TargetKey: "iqn.2003-01.org.example:t/0", Context: map[string]string{"key": "iqn.2003-01.org.example:t/0"},
			AccessType: "block", Staged: true, Device: deviceRecordOf(sdb), StagingPath: "/k/staging/iscsi", Publishes: map[string]publishRecord{}},
		{VolumeID: "vol-luks", Transport: "nvmeof", TargetKey: "nqn.2014-08.org.example:sub/1", Context: map[string]string{"key": "nqn.2014-08.org.example:sub/1"},
			AccessType: "block", Staged: true, Device: deviceRecordOf(nvme), Crypt: &cryptRecord{Name: "berth-vol-luks", Mapping: dm},
			StagingPath: "/k/staging/luks", Publishes: map[string]publishRecord{}},
		{VolumeID: "vol-nosession", Transport: "iscsi", TargetKey: "iqn.2003-01.org.example:u/2", Context: map[string]string{"key": "iqn.2003-01.org.example:u/2"},
			AccessType: "block", Staged: true, Device: deviceRecordOf(sdc), StagingPath: "/k/staging/nosession", Publishes: map[string]publishRecord{}},
	}
	orphan := &devices.Device{Name: "loop7", Path: "/dev/loop7", Major: 7, Minor: 7, ID: devices.Identity{Kind: devices.KindLoop, BackingFile: "/srv/images/old.img"}}
	mounts := []*mountinfo.Info{
		{Major: 8, Minor: 16, Mountpoint: "/mnt/by-hand", FSType: "ext4"},
		{Major: 7, Minor: 7, Mountpoint: "/mnt/old", FSType: "xfs"},
	}
	inv := a.inventoryOf(context.Background(), recs, mounts, []devices.MarkedLoop{{Device: orphan, File: "/srv/images/old.img"}})

	is := inv.Volumes[0]
	if is.Paths["live"] != 1 || is.Paths["failed"] != 1 || is.PathsError != "" {
		t.Errorf("iSCSI volume's paths: %v (%q)", is.Paths, is.PathsError)
	}
	if !is.Abnormal || !strings.Contains(is.Message, "session 4 is FAILED") {
		t.Errorf("iSCSI volume's health: %v, %q", is.Abnormal, is.Message)
	}
	if is.Device == nil || !is.Device.Present || is.Device.Identity != "naa.600140512345678" || is.Usage == nil || is.Usage.TotalBytes != 1<<30 {
		t.Errorf("iSCSI volume's device %+v, usage %+v", is.Device, is.Usage)
	}
	if len(is.OtherMounts) != 1 || is.OtherMounts[0] != "/mnt/by-hand" {
		t.Errorf("iSCSI volume's other mounts: %q, want /mnt/by-hand", is.OtherMounts)
	}

	lu := inv.Volumes[1]
	if lu.Paths["live"] != 2 || lu.Device == nil || !lu.Device.Present {
		t.Errorf("encrypted NVMe volume: paths %v, device %+v", lu.Paths, lu.Device)
	}
	if lu.Mapping == nil || lu.Mapping.Name != "berth-vol-luks" || lu.Mapping.Present || !hasProblem(lu, "dm-crypt mapping berth-vol-luks (253:3) is gone") {
		t.Errorf("encrypted NVMe volume's mapping %+v, problems %q", lu.Mapping, lu.Problems)
	}
	if !lu.Abnormal || !strings.Contains(lu.Message, "dm-crypt mapping") {
		t.Errorf("encrypted NVMe volume's health: %v, %q", lu.Abnormal, lu.Message)
	}

	ns := inv.Volumes[2]
	if ns.Paths != nil || !strings.Contains(ns.PathsError, "no session") || ns.Abnormal || len(ns.Problems) > 0 {
		t.Errorf("volume without a session: paths %v (%q), abnormal %v, problems %q", ns.Paths, ns.PathsError, ns.Abnormal, ns.Problems)
	}

	if len(inv.UnrecordedLoops) != 1 || inv.UnrecordedLoops[0].Device != "/dev/loop7" || len(inv.UnrecordedLoops[0].Mounts) != 1 || inv.UnrecordedLoops[0].Mounts[0] != "/mnt/old" {
		t.Errorf("unrecorded loops: %+v", inv.UnrecordedLoops)
	}
	if inv.Consistent() {
		t.Error("Consistent() with a mapping gone and a loop device unrecorded")
	}
}

// A record of a transport not given, and one whose loop device number is
// another attach's now, are told apart from what disagrees.
func TestInventoryRecordsOnly(t *testing.T) {
	loop := &devices.Device{Name: "loop3", Path: "/dev/loop3", Major: 7, Minor: 3, DiskSeq: 40, ID: devices.Identity{Kind: devices.KindLoop, BackingFile: "/srv/new.img"}}
	a := &Agent{
		log:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		host:       newFakeFS(),
		lookup:     func(string) (*devices.Device, error) { return loop, nil },
		transports: map[string]Transport{},
	}
	rec := &volumeRecord{VolumeID: "v", Transport: "file", TargetKey: "/srv/old.img", AccessType: "block", Staged: true, StagingPath: "/k/s",
		Device: &deviceRecord{Name: "loop3", Path: "/dev/loop3", Major: 7, Minor: 3, DiskSeq: 12, Kind: devices.KindLoop, BackingFile: "/srv/old.img"}, Publishes: map[string]publishRecord{}}
	inv := a.inventoryOf(context.Background(), []*volumeRecord{rec}, nil, []devices.MarkedLoop{{Device: loop, File: "/srv/new.img"}})
	v := inv.Volumes[0]
	if !strings.Contains(v.PathsError, `transport "file" is not enabled here`) {
		t.Errorf("paths error %q", v.PathsError)
	}
	if v.Device.Present || !hasProblem(v, "is gone, or its name is another device now") || !v.Abnormal {
		t.Errorf("volume whose loop number was reused: %+v, problems %q", v.Device, v.Problems)
	}
	if len(inv.UnrecordedLoops) != 1 || inv.UnrecordedLoops[0].Device != "/dev/loop3" {
		t.Errorf("the new attach of the number is not reported as unrecorded: %+v", inv.UnrecordedLoops)
	}
}

// readRecords reads as openStore does but changes nothing: a temporary
// file stays, a missing directory is no record, garbage and a record
// under another volume's name are reported.
func TestReadRecordsChangesNothing(t *testing.T) {
	dir := t.TempDir()
	if recs, damaged, err := readRecords(filepath.Join(dir, "missing")); err != nil || len(recs) != 0 || len(damaged) != 0 {
		t.Fatalf("missing directory: %v, %v, %v", recs, damaged, err)
	}
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(stateFileName("a"), `{"version":1,"volumeID":"a","transport":"file"}`)
	write(stateFileName("b"), "\x00\x00\x00")
	write(stateFileName("c"), `{"version":1,"volumeID":"a"}`)
	write(".tmp-"+stateFileName("a")+"-1", "half")
	recs, damaged, err := readRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || recs[0].VolumeID != "a" {
		t.Errorf("records %v", recs)
	}
	if !strings.Contains(damaged[stateFileName("b")], "all zero") || !strings.Contains(damaged[stateFileName("c")], `holds volume "a"`) || len(damaged) != 2 {
		t.Errorf("damaged %v", damaged)
	}
	if _, err := os.Stat(filepath.Join(dir, ".tmp-"+stateFileName("a")+"-1")); err != nil {
		t.Errorf("temporary file: %v", err)
	}
}
