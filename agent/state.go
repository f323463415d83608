package agent

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
)

// stateVersion is the state format this berth writes into every volume
// record and filesystem mark. It reads every format berth has written
// (see upgradeRecord) and refuses a newer one (see newerFormatError):
//
//  1. v0.1.0's records. A record or mark without a version is format 1
//     (the marks were written so before there were formats).
//  2. Adds the publish's targetMade, the loop device's backingDev and
//     backingIno, crypt, fence, and the marks' version. What v0.1.0
//     makes of it: the README's rollback rule.
const stateVersion = 2

// newerFormatError is a record or mark that a newer berth wrote, in a
// format this one cannot read. It is kept as it is, never rewritten, and
// its volume's calls are refused.
type newerFormatError struct {
	file    string
	version int
}

func (e *newerFormatError) Error() string {
	return fmt.Sprintf("%s is in state format %d, written by a newer berth; this berth writes format %d and reads formats 1 to %d", e.file, e.version, stateVersion, stateVersion)
}

// formatVersion reads the format version of a record or mark file's
// contents b, before anything else of it: a newer format may mean its
// other fields differently. An absent version is format 1.
func formatVersion(file string, b []byte) (int, error) {
	var v struct {
		Version *int `json:"version"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return 0, fmt.Errorf("parse: %w", err)
	}
	switch {
	case v.Version == nil:
		return 1, nil
	case *v.Version < 1:
		return 0, fmt.Errorf("parse: state format %d", *v.Version)
	case *v.Version > stateVersion:
		return 0, &newerFormatError{file: file, version: *v.Version}
	}
	return *v.Version, nil
}

// upgradeRecord makes a record read in format version mean what it meant
// to the berth that wrote it. The record on disk keeps its format until
// it is written again (put), in today's.
//
// Format 1 (v0.1.0) had no targetMade: v0.1.0 removed every publish
// target at unpublish (an empty directory or a file; it had made it, or
// taken an empty one the CO made), so its publishes are unpublished as
// berth's own targets. Its loop devices have no backing file numbers and
// are found again by their image (Target.Detach without rec.Loop); it
// had no crypt and no filesystem marks.
func upgradeRecord(r *volumeRecord, version int) {
	if version == 1 {
		for p, pub := range r.Publishes {
			pub.TargetMade = true
			r.Publishes[p] = pub
		}
	}
	r.Version = version
}

// deviceRecord is what berth remembers about the block device of a staged
// volume: enough to check after a restart that the node still has the
// same device (see devices.Device.Verify).
type deviceRecord struct {
	Name        string `json:"name"`
	Path        string `json:"path"`
	Major       uint32 `json:"major"`
	Minor       uint32 `json:"minor"`
	Size        int64  `json:"size"`
	DiskSeq     uint64 `json:"diskSeq,omitempty"`
	Kind        string `json:"kind,omitempty"`
	WWID        string `json:"wwid,omitempty"`
	HCTL        string `json:"hctl,omitempty"`
	NQN         string `json:"nqn,omitempty"`
	NSID        uint32 `json:"nsid,omitempty"`
	UUID        string `json:"uuid,omitempty"`
	NGUID       string `json:"nguid,omitempty"`
	BackingFile string `json:"backingFile,omitempty"`
	// BackingDev and BackingIno are the device and inode numbers of a
	// loop device's backing file as the kernel reported them at stage
	// (LOOP_GET_STATUS64); with the device's number they find that
	// attach again whatever the file is called by then (see Target.Detach).
	// Records of earlier versions have none.
	BackingDev uint64 `json:"backingDev,omitempty"`
	BackingIno uint64 `json:"backingIno,omitempty"`
	DMName     string `json:"dmName,omitempty"`
}

// path is the recorded device's path, for messages: "<none>" for a
// record that has no device (a stage interrupted before it recorded one,
// or a damaged state file).
func (r *deviceRecord) path() string {
	if r == nil {
		return "<none>"
	}
	return r.Path
}

// loopRef is the loop device attach the record names, nil for a record
// of another kind of device or one without the backing file's numbers.
func (r *deviceRecord) loopRef() *devices.LoopRef {
	if r == nil || r.Kind != devices.KindLoop || r.BackingIno == 0 {
		return nil
	}
	return &devices.LoopRef{Name: r.Name, Major: r.Major, Minor: r.Minor, DiskSeq: r.DiskSeq, BackingDev: r.BackingDev, BackingIno: r.BackingIno}
}

// recorded is what the record says about the device for Target.Detach,
// nil for a record without a device.
func (r *deviceRecord) recorded() *devices.Recorded {
	if r == nil {
		return nil
	}
	return &devices.Recorded{
		ID: devices.Identity{
			Kind: r.Kind, WWID: r.WWID, HCTL: r.HCTL,
			NQN: r.NQN, NSID: r.NSID, UUID: r.UUID, NGUID: r.NGUID,
			BackingFile: r.BackingFile, DMName: r.DMName,
		},
		Loop: r.loopRef(),
	}
}

// publishRecord is one target path a volume is published at.
type publishRecord struct {
	ReadOnly   bool     `json:"readOnly"`
	Mode       string   `json:"mode"`
	MountFlags []string `json:"mountFlags,omitempty"`
	// TargetMade is set when the target did not exist when the publish
	// was recorded: berth creates it, and removes it at unpublish. A
	// target that was there before (the CO's) is left, and so is the
	// target of a record of an earlier version, which has no field.
	TargetMade bool `json:"targetMade,omitempty"`
}

// volumeRecord is the persisted state of one volume on this node. It is
// written before each step that changes the host (intent first), so that
// a retry after a crash at any point finds what may need undoing.
type volumeRecord struct {
	Version   int    `json:"version"`
	VolumeID  string `json:"volumeID"`
	Transport string `json:"transport"`
	// Context is volume_context merged with publish_context. Secrets
	// travel in their own request field and are never stored.
	Context   map[string]string `json:"context"`
	TargetKey string            `json:"targetKey"`
	// TargetID is the identity of the storage (Target.Identity) when it
	// was staged. Records of earlier versions have none; their storage
	// is looked at again when needed.
	TargetID    string   `json:"targetID,omitempty"`
	AccessType  string   `json:"accessType"` // "mount" or "block"
	FsType      string   `json:"fsType,omitempty"`
	MountFlags  []string `json:"mountFlags,omitempty"`
	Mode        string   `json:"mode"`
	StagingPath string   `json:"stagingPath"`
	// StagingRootIno is the inode of the filesystem's root as the staging
	// mount showed it at stage (0 in records of older versions).
	StagingRootIno uint64 `json:"stagingRootIno,omitempty"`
	// Staged is set once NodeStageVolume completed; a record with Staged
	// false is a stage that was interrupted.
	Staged    bool                     `json:"staged"`
	Device    *deviceRecord            `json:"device,omitempty"`
	Publishes map[string]publishRecord `json:"publishes,omitempty"`
	// DeviceReadOnly is set while berth holds the block device of a raw
	// block volume read-only at the block layer (BLKROSET), so that the
	// flag is cleared again, after a restart too, once no read-only
	// publish needs it.
	DeviceReadOnly bool `json:"deviceReadOnly,omitempty"`
	// Formatting is the device berth found blank and started mkfs on,
	// recorded right before mkfs and cleared by the write that records
	// the finished stage. A retried stage that finds this same device
	// (see deviceRecord.identifies) and no mount of it at the staging
	// path makes the format again over what mkfs wrote, which a probe
	// would refuse as foreign data.
	Formatting *deviceRecord `json:"formatting,omitempty"`
	// Crypt is set for a volume encrypted on the node (LUKS2): its
	// dm-crypt mapping sits on Device and holds the filesystem (or is
	// the raw block device published).
	Crypt *cryptRecord `json:"crypt,omitempty"`
	// Fence is the volume's fencing at the target (see fenceStage), nil
	// for a volume that has none (a loop device, a reader-only mode) and
	// in records of earlier versions.
	Fence *fenceRecord `json:"fence,omitempty"`
}

// cryptRecord is the dm-crypt state of an encrypted volume.
type cryptRecord struct {
	// Name is the mapping's name (mappingName), recorded before it is
	// opened.
	Name string `json:"name"`
	// Formatting is the device berth found blank and began to
	// luksFormat, recorded before luksFormat and cleared once the
	// filesystem on the new mapping is made (a raw block volume: once
	// the mapping is open). A retried stage that finds this same device
	// formats it anew: nothing but berth's own partial format is there.
	Formatting *deviceRecord `json:"formatting,omitempty"`
	// Mapping is the open mapping, recorded after the open.
	Mapping *deviceRecord `json:"mapping,omitempty"`
}

// volumeDevice is the device that holds the volume's filesystem, or that
// is published as its raw block device: the dm-crypt mapping of an
// encrypted volume (nil until it is opened), else Device.
func (r *volumeRecord) volumeDevice() *deviceRecord {
	if r.Crypt != nil {
		return r.Crypt.Mapping
	}
	return r.Device
}

// sameStorage reports whether two recorded devices are the same storage:
// the same SCSI WWID (in any of its forms), the same NVMe namespace (NQN
// and namespace ID, or a namespace UUID or NGUID), or the same device
// number, unless disk sequence numbers show the number was given to
// another medium since (a reboot, a loop device reattached).
func sameStorage(a, b *deviceRecord) bool {
	if a == nil || b == nil {
		return false
	}
	if w := devices.NormalizeWWID(a.WWID); w != "" && w == devices.NormalizeWWID(b.WWID) {
		return true
	}
	switch {
	case a.NQN != "" && a.NQN == b.NQN && a.NSID != 0 && a.NSID == b.NSID:
		return true
	case a.UUID != "" && a.UUID == b.UUID:
		return true
	case a.NGUID != "" && a.NGUID == b.NGUID:
		return true
	}
	if a.Major != b.Major || a.Minor != b.Minor {
		return false
	}
	return a.DiskSeq == 0 || b.DiskSeq == 0 || a.DiskSeq == b.DiskSeq
}

func (r *volumeRecord) clone() *volumeRecord {
	c := *r
	c.Context = maps.Clone(r.Context)
	c.MountFlags = slices.Clone(r.MountFlags)
	if r.Device != nil {
		d := *r.Device
		c.Device = &d
	}
	if r.Formatting != nil {
		d := *r.Formatting
		c.Formatting = &d
	}
	if r.Crypt != nil {
		cr := *r.Crypt
		if cr.Formatting != nil {
			d := *cr.Formatting
			cr.Formatting = &d
		}
		if cr.Mapping != nil {
			d := *cr.Mapping
			cr.Mapping = &d
		}
		c.Crypt = &cr
	}
	if r.Fence != nil {
		f := *r.Fence
		c.Fence = &f
	}
	c.Publishes = make(map[string]publishRecord, len(r.Publishes))
	for k, v := range r.Publishes {
		v.MountFlags = slices.Clone(v.MountFlags)
		c.Publishes[k] = v
	}
	return &c
}

// store keeps one JSON file per volume under dir. Volume IDs are chosen
// by the CO and are never used as file names: a record lives in
// sha256(volume_id).json and holds the ID, so "../../etc" stays inside.
// Writes are crash-safe: temporary file, fsync, rename, fsync of dir.
type store struct {
	dir  string
	mu   sync.RWMutex
	vols map[string]*volumeRecord
	// seen is the identity of each volume's storage as this process
	// looked at it (see noteIdentity); a record's TargetID may come from
	// an earlier boot, when an image's device number may have differed.
	seen map[string]string
	// damaged maps the name of each record file openStore could not
	// read (or that a newer berth wrote) to why (see lookup).
	damaged map[string]error
}

func stateFileName(volumeID string) string {
	sum := sha256.Sum256([]byte(volumeID))
	return hex.EncodeToString(sum[:]) + ".json"
}

// openStore creates dir if needed and loads every record in it. A record
// that cannot be read (empty, zeros, not JSON: a disk or filesystem that
// lost what was written; or in a newer format) is kept as it is and
// listed in damaged: it is the only link between its volume and the
// mounts and device berth made for it, and the volume's ID is not known
// without it, so nothing says that the volume is gone from the node.
// The volume's RPCs are refused until the operator restores the file or
// moves it aside, or a berth that reads its format runs (see lookup).
// A record under another volume's file name stops the store.
func openStore(dir string) (*store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create state directory: %w", err)
	}
	s := &store{dir: dir, vols: make(map[string]*volumeRecord), damaged: make(map[string]error)}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read state directory: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".tmp-") {
			// A write that crashed before its rename; the previous
			// version of the record is still in place.
			_ = os.Remove(filepath.Join(dir, name))
			continue
		}
		if !strings.HasSuffix(name, ".json") {
			continue
		}
		r, err := readRecord(filepath.Join(dir, name))
		if err != nil {
			s.damaged[name] = err
			continue
		}
		if stateFileName(r.VolumeID) != name {
			return nil, fmt.Errorf("state file %s holds volume %q, whose record belongs in %s", filepath.Join(dir, name), r.VolumeID, stateFileName(r.VolumeID))
		}
		s.vols[r.VolumeID] = r
	}
	return s, nil
}

// readRecord reads and parses the record file p.
func readRecord(p string) (*volumeRecord, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	if len(bytes.Trim(b, "\x00")) == 0 {
		return nil, fmt.Errorf("%d bytes, all zero", len(b))
	}
	version, err := formatVersion(p, b)
	if err != nil {
		return nil, err
	}
	var r volumeRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	if r.Publishes == nil {
		r.Publishes = make(map[string]publishRecord)
	}
	upgradeRecord(&r, version)
	return &r, nil
}

// damagedFiles returns the paths of the record files openStore could not
// read and are still so, each with why.
func (s *store) damagedFiles() map[string]error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make(map[string]error, len(s.damaged))
	for name, why := range s.damaged {
		out[filepath.Join(s.dir, name)] = why
	}
	return out
}

// lookup is get for an RPC about volume id, which holds the volume's
// lock. A record of the volume that openStore could not read is read
// again, in case the operator restored it or moved it aside; still
// unreadable, it is an error (errdefs.ErrFailedPrecondition) that says
// what to check: berth does not know what it staged for the volume.
func (s *store) lookup(id string) (*volumeRecord, bool, error) {
	name := stateFileName(id)
	s.mu.RLock()
	_, damaged := s.damaged[name]
	s.mu.RUnlock()
	if damaged {
		p := filepath.Join(s.dir, name)
		r, err := readRecord(p)
		var newer *newerFormatError
		switch {
		case errors.As(err, &newer):
			return nil, false, errdefs.FailedPrecondition("volume %q: its state file %v; berth changes nothing of the volume: run a berth that reads format %d for it, or the one that wrote it", id, err, newer.version)
		case errors.Is(err, fs.ErrNotExist):
			s.mu.Lock()
			delete(s.damaged, name)
			s.mu.Unlock()
		case err != nil:
			return nil, false, errdefs.FailedPrecondition("volume %q: its state file %s cannot be read (%v); berth does not know what it staged or published for the volume, and changes nothing of it: check the node for the volume's mounts (its staging and target paths) and its device, and restore the file, or unmount and detach them by hand and move the file out of %s", id, p, err, s.dir)
		case r.VolumeID != id:
			return nil, false, errdefs.FailedPrecondition("volume %q: its state file %s holds volume %q; move it out of %s", id, p, r.VolumeID, s.dir)
		default:
			s.mu.Lock()
			delete(s.damaged, name)
			s.vols[id] = r
			s.mu.Unlock()
		}
	}
	r, ok := s.get(id)
	return r, ok, nil
}

// get returns a copy of the record of a volume.
func (s *store) get(id string) (*volumeRecord, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	r, ok := s.vols[id]
	if !ok {
		return nil, false
	}
	return r.clone(), true
}

// list returns copies of all records, ordered by volume ID.
func (s *store) list() []*volumeRecord {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*volumeRecord, 0, len(s.vols))
	for _, r := range s.vols {
		out = append(out, r.clone())
	}
	slices.SortFunc(out, func(a, b *volumeRecord) int { return strings.Compare(a.VolumeID, b.VolumeID) })
	return out
}

// noteIdentity remembers ident as the identity of volume id's storage as
// this process saw it: when it staged the volume, or when it looked at
// a record it found.
func (s *store) noteIdentity(id, ident string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen == nil {
		s.seen = make(map[string]string)
	}
	s.seen[id] = ident
}

// identity returns what noteIdentity remembered for volume id.
func (s *store) identity(id string) (string, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	ident, ok := s.seen[id]
	return ident, ok
}

// count is the number of volumes on the node: those recorded, and
// those whose record cannot be read.
func (s *store) count() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.vols) + len(s.damaged)
}

// pathOwner returns the volume whose staging path or publish target is p.
func (s *store) pathOwner(p string) (string, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for id, r := range s.vols {
		if r.StagingPath == p {
			return id, true
		}
		if _, ok := r.Publishes[p]; ok {
			return id, true
		}
	}
	return "", false
}

// put writes a record durably, then makes it visible.
func (s *store) put(r *volumeRecord) error {
	r.Version = stateVersion
	if r.Publishes == nil {
		r.Publishes = make(map[string]publishRecord)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("encode state of volume %q: %w", r.VolumeID, err)
	}
	if err := writeFileAtomic(s.dir, stateFileName(r.VolumeID), b); err != nil {
		return fmt.Errorf("save state of volume %q: %w", r.VolumeID, err)
	}
	s.mu.Lock()
	s.vols[r.VolumeID] = r.clone()
	s.mu.Unlock()
	failpoint.Hit("state.put")
	return nil
}

// file is the path of the file that holds the record of volume id.
func (s *store) file(id string) string { return filepath.Join(s.dir, stateFileName(id)) }

// remove deletes the record of a volume; a missing record is not an error.
func (s *store) remove(id string) error {
	err := os.Remove(s.file(id))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove state of volume %q: %w", id, err)
	}
	if err := syncDir(s.dir); err != nil {
		return fmt.Errorf("remove state of volume %q: %w", id, err)
	}
	s.mu.Lock()
	delete(s.vols, id)
	delete(s.seen, id)
	s.mu.Unlock()
	failpoint.Hit("state.remove")
	return nil
}

// writeFileAtomic replaces dir/name with a file holding b: a temporary
// file, synced, renamed over it, and the directory synced.
func writeFileAtomic(dir, name string, b []byte) (retErr error) {
	f, err := os.CreateTemp(dir, ".tmp-"+name+"-")
	if err != nil {
		return err
	}
	defer func() {
		if retErr != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	if _, err := f.Write(b); err != nil {
		return err
	}
	if err := syncFile(f); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	failpoint.Hit("state.written")
	if err := os.Rename(f.Name(), filepath.Join(dir, name)); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return syncFile(d)
}

// syncFile is every fsync of the store (tests count them).
var syncFile = (*os.File).Sync
