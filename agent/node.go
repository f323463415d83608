package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
	berthfs "github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// nodeServer implements the CSI Node service.
//
// Every RPC validates its request before it touches anything, then takes
// the per-volume lock (and the lock of the path it works on) without
// waiting: a second call for a busy volume answers Aborted. State is
// written before each step that changes the host, so a retry after a
// crash finds what may need finishing or undoing.
type nodeServer struct {
	csi.UnimplementedNodeServer
	a *Agent
}

var _ csi.NodeServer = (*nodeServer)(nil)

func notFound(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrNotFound)...)
}

func precondition(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrFailedPrecondition)...)
}

func alreadyExists(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrAlreadyExists)...)
}

// mountOptions returns the mount(2) flags and data of a capability;
// readOnly appends "ro" last so that it wins over a "rw" in mount_flags.
func (n *nodeServer) mountOptions(c volumeCap, readOnly bool) (uintptr, string, error) {
	opts := slices.Clone(c.MountFlags)
	if readOnly {
		opts = append(opts, "ro")
	}
	return n.a.host.ParseMountOptions(opts)
}

// openStaging resolves the staging path once (no symlink on the way, the
// last element included) and checks that it is an existing directory.
// The stage mounts on, and checks, what was opened here.
func openStaging(p string) (*heldPath, *berthfs.Handle, error) {
	sp, err := holdPath("staging_target_path", p)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil, notFound("staging_target_path %q: does not exist (the CO creates it before NodeStageVolume)", p)
	}
	if err != nil {
		return nil, nil, err
	}
	h, err := sp.open()
	if err == nil {
		var st berthfs.PathStat
		if st, err = h.Stat(); err == nil && !st.Dir {
			err = invalid("staging_target_path %q: not a directory", p)
		}
		if err != nil {
			h.Close()
		}
	}
	switch {
	case err == nil:
		return sp, h, nil
	case errors.Is(err, errdefs.ErrNotFound):
		err = notFound("staging_target_path %q: does not exist (the CO creates it before NodeStageVolume)", p)
	case !errors.Is(err, errdefs.ErrInvalidArgument):
		err = fmt.Errorf("staging_target_path %q: %w", p, err)
	}
	sp.close()
	return nil, nil, err
}

// stageRequest is a NodeStageVolume request once validated: everything
// the steps need from it, looked at before any lock is taken.
type stageRequest struct {
	id, staging string
	vcap        volumeCap
	vctx        map[string]string
	secrets     map[string]string
	enc         *berthfs.LUKSOptions // nil: not encrypted
	passphrase  []byte
	tr          Transport
	target      Target
	ident       string // the storage's identity, "" when it cannot be looked at now
}

// stageRun is the state of one NodeStageVolume call between its steps:
// the request, the opened staging path, the volume's record and what the
// steps did so far (which the undo of a failed stage reads).
type stageRun struct {
	stageRequest
	sp   *heldPath
	sh   *berthfs.Handle
	log  *slog.Logger
	took *stepTimer

	rec       *volumeRecord
	known     bool // a record existed before this call
	wasStaged bool // the record said staged before this call
	mounted   bool // this call mounted the staging path
	madeFS    bool // this call's mkfs finished (rec.Formatting stays set until the stage is recorded)

	dev     *devices.Device // the attached device
	vdev    *devices.Device // the device that holds the filesystem: dev, or its dm-crypt mapping
	freshFS bool            // vdev is a new LUKS mapping, berth formats it
}

// NodeStageVolume attaches the volume's storage and, for a mount volume,
// formats it if it is blank, checks it and mounts it at the staging path.
func (n *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (_ *csi.NodeStageVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	sr, err := n.validateStage(req)
	if err != nil {
		return nil, err
	}
	unlock, err := n.a.locks.tryLock(sr.locks()...)
	if err != nil {
		return nil, err
	}
	defer unlock()
	sp, sh, err := openStaging(sr.staging)
	if err != nil {
		return nil, err
	}
	defer sp.close()
	defer sh.Close()
	s := &stageRun{stageRequest: sr, sp: sp, sh: sh, log: logFrom(ctx, n.a.log), took: newStepTimer()}

	if err := n.checkStage(ctx, s); err != nil {
		return nil, err
	}
	if err := n.recordStageIntent(s); err != nil {
		return nil, err
	}
	if done, err := n.stagedAlready(ctx, s); err != nil {
		return nil, err
	} else if done {
		return &csi.NodeStageVolumeResponse{}, nil
	}
	defer func() {
		if retErr != nil {
			n.undoStage(ctx, s)
		}
	}()

	s.took.mark("prepare")
	if err := n.attachDevice(ctx, s); err != nil {
		return nil, err
	}
	if err := n.openMapping(ctx, s); err != nil {
		return nil, err
	}
	if s.vcap.Block {
		if err := n.finishBlockStage(ctx, s); err != nil {
			return nil, err
		}
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if err := n.verifyStageDevices(s); err != nil {
		return nil, err
	}
	if err := n.mountStaging(ctx, s); err != nil {
		return nil, err
	}
	if err := n.finishStage(ctx, s); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// validateStage checks a NodeStageVolume request before anything is
// locked or touched, and parses its target.
func (n *nodeServer) validateStage(req *csi.NodeStageVolumeRequest) (stageRequest, error) {
	s := stageRequest{id: req.GetVolumeId(), staging: req.GetStagingTargetPath(), secrets: req.GetSecrets()}
	if err := validateVolumeID(s.id); err != nil {
		return s, err
	}
	if err := validatePath("staging_target_path", s.staging); err != nil {
		return s, err
	}
	var err error
	if s.vcap, err = validateCapability(req.GetVolumeCapability(), n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions); err != nil {
		return s, err
	}
	if s.vctx, err = mergeContext(req.GetVolumeContext(), req.GetPublishContext()); err != nil {
		return s, err
	}
	if err := validateSecrets(s.secrets); err != nil {
		return s, err
	}
	if s.enc, err = parseEncryption(s.vctx); err != nil {
		return s, err
	}
	if s.enc != nil {
		if s.passphrase, err = passphraseOf(s.secrets); err != nil {
			return s, err
		}
	}
	if s.tr, err = selectTransport(s.vctx, n.a.implied, n.a.transports); err != nil {
		return s, err
	}
	if s.target, err = s.tr.Parse(s.vctx, s.secrets); err != nil {
		return s, err
	}
	// The storage's identity, when it can be looked at now: an image that
	// is gone fails the attach below with its own error.
	if s.ident, err = s.target.Identity(); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return s, err
	}
	return s, nil
}

// locks are the lock keys of a stage. Two volumes naming one storage
// object are staged one at a time, so that the second finds the first's
// record.
func (s *stageRequest) locks() []string {
	locks := []string{volumeKey(s.id), pathKey(s.staging), storageKey(s.tr.Name(), s.target.Key())}
	if s.ident != "" {
		locks = append(locks, storageKey(s.tr.Name(), s.ident))
	}
	return locks
}

// checkStage looks at the node before the stage records anything: the
// transport's and dm-crypt's preflight for a volume not staged yet, a
// repeated stage against its record, the staging path and the storage
// against other volumes. A refusal here changes nothing.
func (n *nodeServer) checkStage(ctx context.Context, s *stageRun) error {
	s.rec, s.known = n.a.state.get(s.id)
	if !s.known || !s.rec.Staged {
		// Before the intent record: a node that cannot attach the
		// target at all keeps nothing that would need unstaging.
		if err := s.target.Preflight(ctx); err != nil {
			return err
		}
		if s.enc != nil {
			if err := n.a.crypt.Check(); err != nil {
				return fmt.Errorf("volume %q: encrypted: %w", s.id, err)
			}
		}
	}
	if s.known {
		if err := compatibleStage(s.rec, s.staging, s.tr.Name(), s.target.Key(), s.vcap); err != nil {
			return err
		}
		if (s.rec.Crypt != nil) != (s.enc != nil) {
			return alreadyExists("volume %q: staged with %s=%t, the request asks for %t", s.id, ContextEncrypted, s.rec.Crypt != nil, s.enc != nil)
		}
	} else if owner, ok := n.a.state.pathOwner(s.staging); ok {
		return alreadyExists("staging_target_path %q: in use by volume %q", s.staging, owner)
	}
	// One storage object is staged once per node: two volumes writing
	// one filesystem through two devices corrupt it. This is checked
	// before anything is attached, and a refusal undoes nothing (undoing
	// would detach what the other volume uses).
	if owner, ok := n.storageOwner(s.id, s.tr, s.target.Key(), s.ident); ok {
		what := s.target.Key()
		if s.ident != "" && s.ident != what {
			what += " (" + s.ident + ")"
		}
		return precondition("%s target %s: the same storage is already staged on this node as volume %q; unstage it first", s.tr.Name(), what, owner)
	}
	if !s.known {
		if max := n.a.cfg.MaxVolumes; max > 0 && int64(n.a.state.count()) >= max {
			return fmt.Errorf("node %s already has %d volumes, its limit (--max-volumes): %w", n.a.cfg.NodeID, max, errdefs.ErrResourceExhausted)
		}
	}
	return nil
}

// recordStageIntent writes the record of a volume not known yet, before
// anything is attached: a crash after Attach leaves a record that
// NodeUnstageVolume (or a retried stage) finishes from. For a target
// whose attach a reboot undoes the record is not waited onto the disk
// (store.putVisible); the stage's next record is.
func (n *nodeServer) recordStageIntent(s *stageRun) error {
	if !s.known {
		s.rec = &volumeRecord{
			VolumeID:    s.id,
			Transport:   s.tr.Name(),
			Context:     withoutSecrets(s.vctx, s.secrets),
			TargetKey:   s.target.Key(),
			TargetID:    s.ident,
			AccessType:  s.vcap.accessType(),
			FsType:      s.vcap.FsType,
			MountFlags:  s.vcap.MountFlags,
			Mode:        s.vcap.Mode.String(),
			StagingPath: s.staging,
		}
		if s.enc != nil {
			s.rec.Crypt = &cryptRecord{Name: mappingName(s.id)}
		}
		put := n.a.state.put
		if rc, ok := s.target.(RebootClearsAttach); ok && rc.RebootClearsAttach() {
			put = n.a.state.putVisible
		}
		if err := put(s.rec); err != nil {
			return err
		}
	}
	if s.ident != "" {
		s.rec.TargetID = s.ident
		n.a.state.noteIdentity(s.id, s.ident)
	}
	s.wasStaged = s.rec.Staged
	return nil
}

// stagedAlready is the fast path of a repeated call: it reports true when
// the staging mount of a staged mount volume is in place and its devices
// are alive. A staged volume that lost its mount is staged again.
func (n *nodeServer) stagedAlready(ctx context.Context, s *stageRun) (bool, error) {
	if !s.wasStaged || s.vcap.Block {
		return false, nil
	}
	rec := s.rec
	m, err := n.a.host.MountInfo(s.sh)
	switch {
	case err == nil:
		if err := checkStagingEntry(rec, m); err != nil {
			return false, err
		}
		// The mount alone does not say the device is alive: a
		// lost controller or a removed LUN leaves a filesystem
		// whose every I/O fails.
		if n.a.recordedDevice(rec.Device) == nil || (rec.Crypt != nil && n.a.recordedDevice(rec.Crypt.Mapping) == nil) {
			return false, precondition("volume %q: its device %s (or its dm-crypt mapping) is gone (target lost or LUN removed) while its filesystem is mounted at %q; the filesystem is dead: NodeUnstageVolume, then stage again", s.id, rec.Device.path(), s.staging)
		}
		return true, nil
	case !errors.Is(err, errdefs.ErrNotFound):
		return false, err
	}
	s.log.WarnContext(ctx, "staged volume is no longer mounted; staging it again")
	return false, nil
}

// undoStage undoes what a failed stage did: the staging mount it made,
// and, for a volume that was not staged before, the mapping, the attach
// and the record. What it cannot undo is logged; NodeUnstageVolume
// retries it.
func (n *nodeServer) undoStage(ctx context.Context, s *stageRun) {
	rec := s.rec
	var errs []error
	if s.mounted {
		// Only the volume's own mount, the one made above.
		errs = append(errs, n.a.host.Unmount(s.sp.dir, s.sp.name, func(m mountEntry) error {
			if !sameDevice(m, rec.volumeDevice()) {
				return precondition("staging_target_path %q: shows device %d:%d, not the mount just made", s.staging, m.Major, m.Minor)
			}
			return nil
		}))
	}
	// A format that started and failed has changed the device: it
	// stays attached with its record, which says so, for the retry
	// to finish (or the unstage to undo).
	if !s.wasStaged && (rec.Formatting == nil || s.madeFS) && (rec.Crypt == nil || rec.Crypt.Formatting == nil) {
		uctx, cancel := n.a.undoContext(ctx)
		defer cancel()
		if err := n.closeMapping(uctx, rec); err != nil {
			errs = append(errs, fmt.Errorf("undo open: %w", err))
		} else if err := n.detach(uctx, rec, s.tr, s.target); err != nil {
			errs = append(errs, fmt.Errorf("undo attach: %w", err))
		} else if err := n.a.state.remove(s.id); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		s.log.ErrorContext(ctx, "undoing a failed stage left work behind; NodeUnstageVolume retries it", slog.String("error", err.Error()))
	}
}

// attachDevice attaches the target and checks that the device is the
// volume's storage: not other storage put behind the recorded number,
// not the device of another staged volume. The device is kept in the
// record in memory only.
func (n *nodeServer) attachDevice(ctx context.Context, s *stageRun) error {
	rec := s.rec
	dev, err := s.target.Attach(ctx)
	if err != nil {
		return err
	}
	s.took.mark("attach")
	s.dev, s.vdev = dev, dev
	s.log = s.log.With(slog.String("device", dev.Path))
	if s.wasStaged && rec.Device != nil && (rec.Device.Major != dev.Major || rec.Device.Minor != dev.Minor) {
		s.log.InfoContext(ctx, "volume came back on another device", slog.String("old_device", rec.Device.path()))
	}
	// The volume_context may name the storage by a number only (a LUN, a
	// namespace ID): storage put behind that number since the device was
	// recorded is another volume's, or blank, and is neither mounted nor
	// formatted as this one.
	if rec.Device != nil {
		if change := rec.Device.storageChange(dev); change != "" {
			return precondition("volume %q: %s target %s now leads to other storage (%s: %s): the LUN or namespace was replaced since the volume was staged; berth does not use it as this volume: NodeUnstageVolume, and check the storage",
				s.id, s.tr.Name(), s.target.Key(), dev.Path, change)
		}
	}
	// (In memory: the undo of a refusal below sees the device and leaves
	// it to its owner.)
	rec.Device = deviceRecordOf(dev)
	// Names the identity check cannot tell apart (a LUN exported under
	// two target names, a namespace given by NSID here and by UUID
	// there) show once attached: the device is another volume's.
	if owner, ok := n.deviceOwner(s.id, rec.Device); ok {
		return precondition("%s target %s: attached as %s, which is the device of volume %q, already staged on this node; unstage it first", s.tr.Name(), s.target.Key(), describeDevice(dev), owner)
	}
	return nil
}

// openMapping opens the dm-crypt mapping of an encrypted volume over its
// device and records it; the mapping is then the device that holds the
// filesystem or is published. An unencrypted volume has nothing to open.
func (n *nodeServer) openMapping(ctx context.Context, s *stageRun) error {
	if s.enc == nil {
		return nil
	}
	rec := s.rec
	m, fresh, err := n.openEncrypted(ctx, rec, s.dev, *s.enc, s.passphrase, s.wasStaged)
	if err != nil {
		return err
	}
	s.took.mark("open")
	rec.Crypt.Mapping = deviceRecordOf(m)
	if fresh && s.vcap.Block {
		rec.Crypt.Formatting = nil // nothing more to make
	}
	if err := n.a.state.put(rec); err != nil {
		return err
	}
	s.vdev, s.freshFS = m, fresh && !s.vcap.Block
	s.log = s.log.With(slog.String("mapping", m.ID.DMName))
	return nil
}

// finishBlockStage ends the stage of a raw block volume: the device is
// published directly, nothing is mounted at the staging path. A stage
// repeated after a crash or on a new device brings the read-only flag in
// line with the recorded publishes; the device is recorded before its
// flag is touched.
func (n *nodeServer) finishBlockStage(ctx context.Context, s *stageRun) error {
	rec := s.rec
	if err := n.a.state.put(rec); err != nil {
		return err
	}
	if err := n.syncDeviceReadOnly(rec, s.vdev); err != nil {
		return err
	}
	rec.Staged = true
	if err := n.a.state.put(rec); err != nil {
		return err
	}
	s.took.mark("record")
	s.log.InfoContext(ctx, "staged for raw block access", s.took.attr())
	return nil
}

// verifyStageDevices checks that the device names still mean the devices
// attached (and opened) before their filesystem is looked at.
func (n *nodeServer) verifyStageDevices(s *stageRun) error {
	if err := n.a.verify(s.dev); err != nil {
		return err
	}
	if s.vdev != s.dev {
		if err := n.a.verify(s.vdev); err != nil {
			return err
		}
	}
	s.took.mark("verify")
	return nil
}

// mountStaging makes the staging mount of a mount volume: it accepts the
// volume's own mount left by an attempt that crashed before recording,
// refuses any other mount there, and otherwise prepares the filesystem
// and mounts it.
func (n *nodeServer) mountStaging(ctx context.Context, s *stageRun) error {
	rec := s.rec
	m, err := n.a.host.MountInfo(s.sh)
	switch {
	case err == nil && sameDevice(m, rec.volumeDevice()):
		// A previous attempt mounted it and crashed before recording.
		if err := checkStagingEntry(rec, m); err != nil {
			return err
		}
		rec.StagingRootIno = m.Ino
		return nil
	case err == nil:
		return precondition("staging_target_path %q: holds a mount of device %d:%d (%s), not of the volume's device %s", s.staging, m.Major, m.Minor, m.FSType, s.vdev.Path)
	case !errors.Is(err, errdefs.ErrNotFound):
		return err
	}
	if err := n.prepareFilesystem(ctx, s); err != nil {
		return err
	}
	return n.mountFilesystem(s)
}

// prepareFilesystem makes the volume's filesystem on a blank device (or a
// new LUKS mapping) or checks the one that is there.
func (n *nodeServer) prepareFilesystem(ctx context.Context, s *stageRun) error {
	rec, vcap, vdev := s.rec, s.vcap, s.vdev
	var formatted bool
	if s.freshFS {
		// A new LUKS device: its mapping reads as noise, which no
		// probe calls blank; the blank underlying device was the
		// proof, and the record says the format is berth's.
		if err := n.a.host.Format(ctx, vdev.Path, vcap.FsType); err != nil {
			return err
		}
		rec.Crypt.Formatting = nil
		if err := n.a.state.put(rec); err != nil {
			return err
		}
		formatted = true
	} else {
		var err error
		if formatted, err = n.ensureFilesystem(ctx, rec, vdev, vcap.FsType, s.took); err != nil {
			if errors.Is(err, berthfs.ErrLUKSDevice) && s.enc == nil {
				err = fmt.Errorf("volume %q: %w; it is staged only as an encrypted volume: volume_context %s=\"true\" and its passphrase in node_stage_secrets %q",
					s.id, err, ContextEncrypted, SecretEncryptionPassphrase)
			}
			return err
		}
	}
	if formatted {
		s.madeFS = true
		s.took.mark("format")
		s.log.InfoContext(ctx, "created filesystem", slog.String("fs_type", vcap.FsType))
	} else {
		s.took.mark("probe")
		// The filesystem is on vdev: an encrypted volume's mapping, whose
		// LUKS device under it is held and so never checked.
		if err := n.a.host.Fsck(ctx, vdev.Path, vcap.FsType); err != nil {
			return err
		}
		s.took.mark("fsck")
	}
	return nil
}

// mountFilesystem mounts the volume's filesystem at the staging path,
// once the device name is checked again, and checks the mount it made.
func (n *nodeServer) mountFilesystem(s *stageRun) error {
	rec, vcap, vdev := s.rec, s.vcap, s.vdev
	// mkfs and fsck take time; make sure the name still means the
	// device we checked before mounting it.
	if err := n.a.verify(vdev); err != nil {
		return err
	}
	s.took.mark("verify_again")
	flags, data, err := n.mountOptions(vcap, vcap.readOnly())
	if err != nil {
		return err
	}
	if err := n.a.host.Mount(vdev.Path, s.sh, vcap.FsType, flags, xfsNoUUID(vcap.FsType, data)); err != nil {
		return err
	}
	s.mounted = true
	s.took.mark("mount")
	root, err := n.a.mountAt(s.sp)
	if err != nil {
		return fmt.Errorf("staging_target_path %q: check the new mount: %w", s.staging, err)
	}
	if !sameDevice(root, rec.volumeDevice()) {
		return fmt.Errorf("staging_target_path %q: after mounting %s it shows device %d:%d", s.staging, vdev.Path, root.Major, root.Minor)
	}
	// The inode of the filesystem's root: later checks tell the
	// volume's root from a directory inside it by it.
	rec.StagingRootIno = root.Ino
	return nil
}

// finishStage records a mount volume as staged. Its device is recorded
// with the finished stage: undoing an interrupted one needs only the
// staging path and the target, both recorded before the attach.
func (n *nodeServer) finishStage(ctx context.Context, s *stageRun) error {
	s.rec.Staged = true
	// The format is finished and mounted: the mark goes with this write.
	s.rec.Formatting = nil
	if err := n.a.state.put(s.rec); err != nil {
		return err
	}
	s.took.mark("record")
	s.log.InfoContext(ctx, "staged", slog.String("fs_type", s.vcap.FsType), s.took.attr())
	return nil
}

// xfsNoUUID adds nouuid to the mount data of an xfs filesystem. xfs
// refuses to mount a second filesystem with a UUID already mounted, which
// is what a clone or a restored snapshot of a staged volume has. Its
// purpose, never mounting the same storage twice, berth serves by
// identity instead: one storage object stages as one volume only, and a
// device is checked against every staged one.
func xfsNoUUID(fsType, data string) string {
	if fsType != "xfs" || slices.Contains(strings.Split(data, ","), "nouuid") {
		return data
	}
	if data == "" {
		return "nouuid"
	}
	return data + ",nouuid"
}

func storageKey(transport, key string) string { return fmt.Sprintf("%s storage %q", transport, key) }

// storageOwner returns another volume staged (or being staged) on this
// node from the same storage as the target with key and identity ident
// ("" when it cannot be looked at): the same key, the same recorded
// identity, or, since the device and inode numbers of an image may
// change (a reboot, a record of an earlier version without identity),
// the same identity as this process saw it. A record this process did
// not stage is looked at once (its storage's identity now), not at
// every call: with many volumes on a node, each stage would otherwise
// look at every other volume's storage.
func (n *nodeServer) storageOwner(id string, tr Transport, key, ident string) (string, bool) {
	for _, r := range n.a.state.list() {
		if r.VolumeID == id || r.Transport != tr.Name() {
			continue
		}
		if r.TargetKey == key || (ident != "" && r.TargetID == ident) {
			return r.VolumeID, true
		}
		if ident == "" {
			continue
		}
		cur, ok := n.a.state.identity(r.VolumeID)
		if !ok {
			t, err := tr.Parse(r.Context, nil)
			if err != nil {
				continue
			}
			if cur, err = t.Identity(); err != nil {
				continue
			}
			n.a.state.noteIdentity(r.VolumeID, cur)
		}
		if cur == ident {
			return r.VolumeID, true
		}
	}
	return "", false
}

// deviceOwner returns another volume whose recorded device is the same
// storage as d (see sameStorage).
func (n *nodeServer) deviceOwner(id string, d *deviceRecord) (string, bool) {
	for _, r := range n.a.state.list() {
		if r.VolumeID != id && sameStorage(r.Device, d) {
			return r.VolumeID, true
		}
	}
	return "", false
}

// detach detaches the target of a volume's record, unless another volume
// uses the same storage: its loop device, session or controller is then
// that volume's too, and stays. This happens only with records written
// before berth compared identities, or with an interrupted stage that was
// refused on retry; the record is dropped either way.
func (n *nodeServer) detach(ctx context.Context, rec *volumeRecord, tr Transport, target Target) error {
	ident, err := target.Identity()
	if err != nil {
		ident = rec.TargetID // the image is gone: what it was
	}
	owner, shared := n.storageOwner(rec.VolumeID, tr, target.Key(), ident)
	if !shared && rec.Device != nil {
		owner, shared = n.deviceOwner(rec.VolumeID, rec.Device)
	}
	if shared {
		logFrom(ctx, n.a.log).WarnContext(ctx, "not detaching: another volume uses the same storage", slog.String("other_volume_id", owner))
		return nil
	}
	if ld, ok := target.(LoopDetacher); ok {
		return ld.DetachLoop(ctx, rec.Device.loopRef())
	}
	return target.Detach(ctx)
}

// compatibleStage checks a repeated stage against the recorded one.
func compatibleStage(rec *volumeRecord, staging, transport, key string, c volumeCap) error {
	id := rec.VolumeID
	switch {
	case rec.StagingPath != staging:
		return precondition("volume %q: already staged at %q; unstage it there first", id, rec.StagingPath)
	case rec.Transport != transport || rec.TargetKey != key:
		return alreadyExists("volume %q: staged from %s target %s, the request names %s target %s", id, rec.Transport, rec.TargetKey, transport, key)
	case rec.AccessType != c.accessType():
		return alreadyExists("volume %q: staged with access type %s, the request asks for %s", id, rec.AccessType, c.accessType())
	case rec.FsType != c.FsType:
		return alreadyExists("volume %q: staged with fs_type %s, the request asks for %s", id, rec.FsType, c.FsType)
	case rec.Mode != c.Mode.String():
		return alreadyExists("volume %q: staged with access mode %s, the request asks for %s", id, rec.Mode, c.Mode)
	case !slices.Equal(rec.MountFlags, c.MountFlags):
		return alreadyExists("volume %q: staged with mount_flags %q, the request has %q", id, rec.MountFlags, c.MountFlags)
	}
	return nil
}

// withoutSecrets drops context entries whose key or value is also a
// secret, so that a credential put in the wrong map is not persisted.
// The secret values are looked up in a set: linear in both maps.
func withoutSecrets(vctx, secrets map[string]string) map[string]string {
	values := make(map[string]struct{}, len(secrets))
	for _, s := range secrets {
		if s != "" {
			values[s] = struct{}{}
		}
	}
	out := make(map[string]string, len(vctx))
	for k, v := range vctx {
		_, key := secrets[k]
		_, value := values[v]
		if !key && !value {
			out[k] = v
		}
	}
	return out
}

// lockVolumePath validates a volume ID and a path field of a request that
// names nothing else, then takes the locks of both (Aborted when busy).
func (n *nodeServer) lockVolumePath(id, field, p string) (unlock func(), err error) {
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if err := validatePath(field, p); err != nil {
		return nil, err
	}
	return n.a.locks.tryLock(volumeKey(id), pathKey(p))
}

// NodeUnstageVolume undoes a stage: the staging mount, the read-only
// flag berth set, the dm-crypt mapping, the attach and the record.
func (n *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (_ *csi.NodeUnstageVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	unlock, err := n.lockVolumePath(id, "staging_target_path", staging)
	if err != nil {
		return nil, err
	}
	defer func() { unlock() }() // a step left blocked in the kernel takes it over
	log := logFrom(ctx, n.a.log)
	took := newStepTimer()

	rec, ok := n.a.state.get(id)
	if !ok {
		// Not staged (or already unstaged): the CSI answer is OK.
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if rec.StagingPath != staging {
		log.WarnContext(ctx, "volume is staged at another path; nothing to do here", slog.String("recorded_staging_path", rec.StagingPath))
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if err := n.dropStalePublishes(ctx, rec, took); err != nil {
		return nil, err
	}
	tr, target, err := n.unstageTarget(rec)
	if err != nil {
		return nil, err
	}
	unreachable, err := n.stopQueueing(ctx, rec, target, &unlock)
	if err != nil {
		return nil, err
	}
	if err := n.releaseStagedDevice(ctx, rec, unreachable, &unlock, took); err != nil {
		return nil, err
	}
	if err := n.blocking(ctx, "detach", &unlock, func() error { return n.detach(ctx, rec, tr, target) }); err != nil {
		return nil, err
	}
	took.mark("detach")
	if err := n.a.state.remove(id); err != nil {
		return nil, err
	}
	took.mark("record")
	if rec.Device != nil {
		log = log.With(slog.String("device", rec.Device.path()))
	}
	log.InfoContext(ctx, "unstaged", took.attr())
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// dropStalePublishes checks the publish records at unstage. The CO
// unpublishes before it unstages. A volume still mounted in a pod is
// refused rather than torn out from under it; a publish record whose
// mount is gone is stale and dropped.
func (n *nodeServer) dropStalePublishes(ctx context.Context, rec *volumeRecord, took *stepTimer) error {
	for target := range rec.Publishes {
		if err := n.dropStalePublish(ctx, rec, target); err != nil {
			return err
		}
	}
	took.mark("publishes")
	return nil
}

// unstageTarget parses the recorded target of a volume to unstage,
// through the transport it was staged with.
func (n *nodeServer) unstageTarget(rec *volumeRecord) (Transport, Target, error) {
	tr, ok := n.a.transports[rec.Transport]
	if !ok {
		return nil, nil, precondition("volume %q: staged through transport %q, which is not enabled any more; enable it to unstage", rec.VolumeID, rec.Transport)
	}
	target, err := tr.Parse(rec.Context, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("volume %q: recorded volume_context: %w", rec.VolumeID, err)
	}
	// The key was computed from the context at stage and stored beside
	// it: a context that gives another now was changed on disk, and
	// detaching what it names would tear down other storage and drop
	// the record of what is still attached.
	if key := target.Key(); rec.TargetKey != "" && key != rec.TargetKey {
		return nil, nil, precondition("volume %q: staged from %s target %s, but its recorded volume_context names %s target %s: the state file %s was changed since the stage; berth detaches neither: restore the record, or detach the volume's storage by hand and remove the file",
			rec.VolumeID, rec.Transport, rec.TargetKey, rec.Transport, key, n.a.state.file(rec.VolumeID))
	}
	return tr, target, nil
}

// stopQueueing makes a device none of whose paths works fail I/O, rather
// than queue it until one comes back, so that the unmount's writeback and
// the flush at unstage end. What they could not write is lost either
// way. It reports whether the storage is unreachable.
func (n *nodeServer) stopQueueing(ctx context.Context, rec *volumeRecord, target Target, unlock *func()) (bool, error) {
	var unreachable bool
	err := n.blocking(ctx, "stop queueing I/O of the volume's device", unlock, func() error {
		u, err := target.StopQueueing(ctx)
		unreachable = u
		return err
	})
	if err != nil {
		return false, fmt.Errorf("volume %q: %w", rec.VolumeID, err)
	}
	if unreachable {
		logFrom(ctx, n.a.log).WarnContext(ctx, "no path to the storage works: the device fails I/O; data not yet written is lost")
	}
	return unreachable, nil
}

// releaseStagedDevice lets go of the volume's device at unstage: it
// unmounts the staging mount of a mount volume, clears the read-only flag
// berth set, flushes the device's buffers (unless it fails I/O anyway)
// and closes the dm-crypt mapping. Each step that may block in the kernel
// runs through blocking.
func (n *nodeServer) releaseStagedDevice(ctx context.Context, rec *volumeRecord, unreachable bool, unlock *func(), took *stepTimer) error {
	if rec.AccessType != "block" {
		if err := n.blocking(ctx, fmt.Sprintf("unmount %s", rec.StagingPath), unlock, func() error { return n.unmountStaging(rec) }); err != nil {
			return err
		}
		took.mark("unmount")
	}
	if d := n.a.recordedDevice(rec.volumeDevice()); d != nil {
		// No publish is left: a flag berth set is cleared, so that the
		// next user of the device finds it writable.
		if err := n.syncDeviceReadOnly(rec, d); err != nil {
			return err
		}
		// A device that fails I/O could only fail the flush.
		if !unreachable {
			if err := n.blocking(ctx, "flush "+d.Path, unlock, func() error { return n.a.host.FlushBuffers(d.Path) }); err != nil {
				return err
			}
		}
		took.mark("flush")
	}
	if rec.Crypt != nil {
		if err := n.blocking(ctx, "close the dm-crypt mapping", unlock, func() error { return n.closeMapping(ctx, rec) }); err != nil {
			return err
		}
		took.mark("close")
	}
	return nil
}

// blocking runs step, which may call into the kernel where a device that
// answers no I/O keeps it from returning (an unmount's writeback, a
// flush), and waits for it until ctx ends. A step still running then goes
// on in the background and takes the RPC's locks over (*unlock becomes a
// no-op for the caller) until it returns: the volume answers Aborted
// meanwhile, and the CO's next retry finds what the step did. The step
// must not use what the caller changes or closes after it returns; what
// it needs closed afterwards is closed in *unlock.
func (n *nodeServer) blocking(ctx context.Context, what string, unlock *func(), step func() error) error {
	done := make(chan error, 1)
	go func() { done <- step() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	release := *unlock
	*unlock = func() {}
	log := logFrom(ctx, n.a.log)
	start := time.Now()
	go func() {
		err := <-done
		release()
		attrs := []any{slog.String("step", what), slog.Duration("after", time.Since(start).Round(time.Millisecond))}
		if err != nil {
			attrs = append(attrs, slog.String("error", err.Error()))
		}
		log.Info("step left running at the deadline ended", attrs...)
	}()
	return fmt.Errorf("%s: still waiting in the kernel at the request's deadline (the device answers no I/O: check the paths to the storage); it goes on, and the volume is busy until it ends: %w",
		what, errors.Join(errdefs.ErrUnavailable, ctx.Err()))
}

// dropStalePublish forgets a publish record at unstage. A target still
// mounted is refused rather than torn out from under its pod; one whose
// mount is gone is removed (if berth can) and its record dropped.
func (n *nodeServer) dropStalePublish(ctx context.Context, rec *volumeRecord, target string) error {
	tp, err := holdPath("target_path", target)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		// Its directory is gone, and whatever was mounted in it.
	case err != nil:
		// Through a symlink berth cannot tell whether the volume is
		// still mounted there.
		return fmt.Errorf("volume %q: check publish target: %w", rec.VolumeID, err)
	default:
		defer tp.close()
		_, err := n.a.mountAt(tp)
		switch {
		case err == nil:
			return precondition("volume %q: still published at %q; NodeUnpublishVolume first", rec.VolumeID, target)
		case !errors.Is(err, errdefs.ErrNotFound):
			return fmt.Errorf("check publish target %q: %w", target, err)
		}
		if err := removeTarget(tp); err != nil {
			// A stale record must not block the unstage the CO asks
			// for; the path is left for the operator.
			logFrom(ctx, n.a.log).WarnContext(ctx, "stale publish target not removed", slog.String("target_path", target), slog.String("error", err.Error()))
		}
	}
	delete(rec.Publishes, target)
	return n.a.state.put(rec)
}

// unmountStaging unmounts the staging mount of a mount volume at unstage.
// The staging path is opened again (no symlink on the way) and each
// mount there is checked before it is unmounted: it must be the volume's
// own (checkStagingEntry). Another volume's mount reached through a
// swapped path, or put at the staging path, is refused and left alone. A
// record without a device (a stage interrupted before it recorded one)
// cannot say which mount is its own: any mount but one of another
// recorded volume is taken as the one the interrupted stage made.
func (n *nodeServer) unmountStaging(rec *volumeRecord) error {
	sp, err := holdPath("staging_target_path", rec.StagingPath)
	if errors.Is(err, errdefs.ErrNotFound) {
		// Nothing can be mounted in a directory that is gone.
		return nil
	}
	if err != nil {
		return err
	}
	defer sp.close()
	return n.a.host.Unmount(sp.dir, sp.name, func(m mountEntry) error {
		if rec.Device != nil {
			return checkStagingEntry(rec, m)
		}
		if owner, ok := n.a.mountOwner(m, rec.VolumeID); ok {
			return precondition("volume %q: staging path %q shows device %d:%d of volume %q; refusing to unmount it", rec.VolumeID, rec.StagingPath, m.Major, m.Minor, owner)
		}
		return nil
	})
}

// publishRequest is a NodePublishVolume request once validated.
type publishRequest struct {
	id, target, staging string
	vcap                volumeCap
	readOnly            bool
}

// NodePublishVolume bind-mounts a staged volume (its staging mount, or
// its device node for raw block) at the target path.
func (n *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (_ *csi.NodePublishVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	pr, err := n.validatePublish(req)
	if err != nil {
		return nil, err
	}
	unlock, err := n.a.locks.tryLock(volumeKey(pr.id), pathKey(pr.target))
	if err != nil {
		return nil, err
	}
	defer unlock()
	took := newStepTimer()
	tp, err := holdPath("target_path", pr.target)
	if err != nil {
		return nil, err
	}
	defer tp.close()

	rec, err := n.checkPublish(pr, tp)
	if err != nil {
		return nil, err
	}
	var source *berthfs.Handle
	if !pr.vcap.Block {
		if source, err = n.openPublishStaging(rec, pr); err != nil {
			return nil, err
		}
		defer source.Close()
	}
	if done, err := n.recordPublishIntent(rec, pr, tp); err != nil {
		return nil, err
	} else if done {
		return &csi.NodePublishVolumeResponse{}, nil
	}

	var (
		created bool
		dev     *devices.Device // raw block only
	)
	defer func() {
		if retErr != nil {
			n.undoPublish(ctx, rec, pr.target, tp, created, dev)
		}
	}()
	if pr.vcap.Block {
		if dev, source, err = n.openPublishDevice(rec, pr.id); err != nil {
			return nil, err
		}
		defer source.Close()
	}
	took.mark("check")
	if created, err = n.bindTarget(rec, pr, tp, source, dev, took); err != nil {
		return nil, err
	}
	logFrom(ctx, n.a.log).InfoContext(ctx, "published", slog.Bool("read_only", pr.readOnly), took.attr())
	return &csi.NodePublishVolumeResponse{}, nil
}

// validatePublish checks a NodePublishVolume request before anything is
// locked or touched.
func (n *nodeServer) validatePublish(req *csi.NodePublishVolumeRequest) (publishRequest, error) {
	p := publishRequest{id: req.GetVolumeId(), target: req.GetTargetPath(), staging: req.GetStagingTargetPath()}
	if err := validateVolumeID(p.id); err != nil {
		return p, err
	}
	if err := validatePath("target_path", p.target); err != nil {
		return p, err
	}
	var err error
	if p.vcap, err = validateCapability(req.GetVolumeCapability(), n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions); err != nil {
		return p, err
	}
	if p.staging == "" {
		return p, precondition("staging_target_path: missing; berth has the STAGE_UNSTAGE_VOLUME capability and publishes staged volumes only")
	}
	if err := validatePath("staging_target_path", p.staging); err != nil {
		return p, err
	}
	if p.staging == p.target {
		return p, invalid("target_path: equal to staging_target_path")
	}
	if _, err := mergeContext(req.GetVolumeContext(), req.GetPublishContext()); err != nil {
		return p, err
	}
	if err := validateSecrets(req.GetSecrets()); err != nil {
		return p, err
	}
	p.readOnly = req.GetReadonly() || p.vcap.readOnly()
	return p, nil
}

// checkPublish checks a publish against the volume's record: staged, at
// the staging path and with the access type and fs_type of the request;
// and the target path: no other volume's, not inside a staging path.
func (n *nodeServer) checkPublish(p publishRequest, tp *heldPath) (*volumeRecord, error) {
	id := p.id
	rec, ok := n.a.state.get(id)
	switch {
	case !ok || !rec.Staged:
		return nil, precondition("volume %q: not staged on this node; NodeStageVolume first", id)
	case rec.StagingPath != p.staging:
		return nil, precondition("volume %q: staged at %q, not at %q", id, rec.StagingPath, p.staging)
	case rec.AccessType != p.vcap.accessType():
		return nil, precondition("volume %q: staged with access type %s, publish asks for %s", id, rec.AccessType, p.vcap.accessType())
	case rec.FsType != p.vcap.FsType:
		return nil, precondition("volume %q: staged with fs_type %s, publish asks for %s", id, rec.FsType, p.vcap.FsType)
	}
	if owner, ok := n.a.state.pathOwner(p.target); ok && owner != id {
		return nil, alreadyExists("target_path %q: in use by volume %q", p.target, owner)
	}
	if err := n.a.checkTargetOutsideStaging(tp); err != nil {
		return nil, err
	}
	return rec, nil
}

// openPublishStaging opens the staging mount of a mount volume, the
// source of its bind. Binding a staging path that lost its mount would
// publish a directory of the node's root filesystem. What is bound is
// the descriptor checked here.
func (n *nodeServer) openPublishStaging(rec *volumeRecord, p publishRequest) (*berthfs.Handle, error) {
	source, err := n.a.openStagingMount(rec)
	if err != nil {
		return nil, err
	}
	// The staging mount outlives its device (a lost controller, a
	// LUN removed or replaced): its filesystem fails every I/O and
	// is not given to a pod.
	if n.a.recordedDevice(rec.Device) == nil || n.a.recordedDevice(rec.volumeDevice()) == nil {
		source.Close()
		return nil, precondition("volume %q: its device %s is gone or changed since stage (target lost, LUN or namespace removed or replaced) while its filesystem is mounted at %q; the filesystem is dead: NodeUnstageVolume, then stage again", p.id, rec.Device.path(), p.staging)
	}
	return source, nil
}

// recordPublishIntent checks a publish against the volume's other
// publishes and records a new one before the target is touched. A
// repeated publish whose mount is in place is done (true); a recorded
// one whose mount is not is an interrupted publish, finished by the
// steps that follow.
func (n *nodeServer) recordPublishIntent(rec *volumeRecord, p publishRequest, tp *heldPath) (bool, error) {
	id, target, vcap := p.id, p.target, p.vcap
	want := publishRecord{ReadOnly: p.readOnly, Mode: vcap.Mode.String(), MountFlags: vcap.MountFlags}
	if have, ok := rec.Publishes[target]; ok {
		if have.ReadOnly != want.ReadOnly || have.Mode != want.Mode || !slices.Equal(have.MountFlags, want.MountFlags) {
			return false, alreadyExists("volume %q: published at %q with readonly=%t mode=%s mount_flags=%q; the request has readonly=%t mode=%s mount_flags=%q",
				id, target, have.ReadOnly, have.Mode, have.MountFlags, want.ReadOnly, want.Mode, want.MountFlags)
		}
		m, err := n.a.mountAt(tp)
		mounted := err == nil
		switch {
		case mounted:
			err = checkPublishedEntry(rec, target, m)
		case errors.Is(err, errdefs.ErrNotFound):
			err = nil
		}
		if err != nil {
			return false, err
		}
		if mounted {
			if vcap.Block {
				if err := n.syncRecordedReadOnly(rec); err != nil {
					return false, err
				}
			}
			return true, nil
		}
		// Recorded but not mounted: an interrupted publish; finish it.
		return false, nil
	}
	single := vcap.singleWriter()
	for other, pub := range rec.Publishes {
		if single || pub.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER.String() {
			return false, precondition("volume %q: access mode SINGLE_NODE_SINGLE_WRITER allows one target and it is published at %q", id, other)
		}
		if vcap.Block && !vcap.readOnly() && pub.ReadOnly != want.ReadOnly {
			// The block layer has one read-only flag per device:
			// read-only and read-write raw block publishes of one
			// volume cannot both be what they say.
			return false, precondition("volume %q: published %s at %q; a raw block device is read-only for all its publishes or for none, so a %s publish beside it is refused: unpublish it first",
				id, rwName(pub.ReadOnly), other, rwName(want.ReadOnly))
		}
	}
	_, err := n.a.mountAt(tp)
	switch {
	case err == nil:
		return false, alreadyExists("target_path %q: already a mount point that berth did not make for volume %q", target, id)
	case !errors.Is(err, errdefs.ErrNotFound):
		return false, err
	}
	rec.Publishes[target] = want
	return false, n.a.state.put(rec)
}

// undoPublish undoes a failed publish: the target it created, its
// record and, for raw block, the read-only flag that record asked for.
// What it cannot undo is logged.
func (n *nodeServer) undoPublish(ctx context.Context, rec *volumeRecord, target string, tp *heldPath, created bool, dev *devices.Device) {
	var errs []error
	if created {
		errs = append(errs, removeTarget(tp))
	}
	if errors.Join(errs...) == nil {
		delete(rec.Publishes, target)
		if dev != nil {
			errs = append(errs, n.syncDeviceReadOnly(rec, dev))
		}
		errs = append(errs, n.a.state.put(rec))
	}
	if err := errors.Join(errs...); err != nil {
		logFrom(ctx, n.a.log).ErrorContext(ctx, "undoing a failed publish left work behind", slog.String("error", err.Error()))
	}
}

// openPublishDevice opens the device node of a raw block volume (its
// dm-crypt mapping when encrypted), the source of its bind, once it is
// checked to be the device staged.
func (n *nodeServer) openPublishDevice(rec *volumeRecord, id string) (*devices.Device, *berthfs.Handle, error) {
	d := n.a.recordedDevice(rec.volumeDevice())
	if d == nil || n.a.recordedDevice(rec.Device) == nil {
		return nil, nil, precondition("volume %q: its device %s (or its dm-crypt mapping) is gone or changed since stage; unstage and stage again", id, rec.Device.path())
	}
	source, err := n.a.host.OpenDeviceNode(d.Path, d.Major, d.Minor)
	if err != nil {
		return nil, nil, err
	}
	// A read-only bind mount does not stop writes through a device
	// node: the block layer's flag must, before the pod sees it.
	return d, source, nil
}

// bindTarget creates the target (a directory, or a file for raw block),
// sets the device's read-only flag for raw block, and bind-mounts source
// there. created reports whether it created the target, also on error.
func (n *nodeServer) bindTarget(rec *volumeRecord, p publishRequest, tp *heldPath, source *berthfs.Handle, dev *devices.Device, took *stepTimer) (bool, error) {
	th, created, err := prepareTarget(tp, p.vcap.Block)
	if err != nil {
		return created, err
	}
	defer th.Close()
	took.mark("target")
	if dev != nil {
		if err := n.syncDeviceReadOnly(rec, dev); err != nil {
			return created, err
		}
		took.mark("read_only")
	}
	flags, _, err := n.mountOptions(p.vcap, false)
	if err != nil {
		return created, err
	}
	if err := n.a.host.BindMount(source, th, p.readOnly, flags); err != nil {
		return created, err
	}
	took.mark("bind")
	return created, nil
}

// NodeUnpublishVolume unmounts a volume's bind at the target path,
// removes the target and forgets the publish.
func (n *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (_ *csi.NodeUnpublishVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, target := req.GetVolumeId(), req.GetTargetPath()
	unlock, err := n.lockVolumePath(id, "target_path", target)
	if err != nil {
		return nil, err
	}
	defer func() { unlock() }() // a step left blocked in the kernel takes it over
	took := newStepTimer()

	rec, ok := n.a.state.get(id)
	_, published := rec.publishes()[target]
	tp, err := holdTarget(target, &unlock)
	if err != nil {
		return nil, err
	}
	if !ok || !published {
		if err := n.unpublishedAlready(rec, id, target, tp); err != nil {
			return nil, err
		}
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if tp != nil {
		if err := n.unmountTarget(ctx, id, target, tp, &unlock, took); err != nil {
			return nil, err
		}
	}
	if err := n.forgetPublish(rec, target, took); err != nil {
		return nil, err
	}
	logFrom(ctx, n.a.log).InfoContext(ctx, "unpublished", took.attr())
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// holdTarget holds the target path of an unpublish: nil when its
// directory is gone, and whatever was mounted in it. The held path is
// closed with the locks (*unlock): by a step left blocked in the kernel
// when it ends (see blocking).
func holdTarget(target string, unlock *func()) (*heldPath, error) {
	tp, err := holdPath("target_path", target)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, nil
	case err != nil:
		return nil, err
	}
	held, release := tp, *unlock
	*unlock = func() { held.close(); release() }
	return tp, nil
}

// unpublishedAlready answers an unpublish of a target the volume has no
// publish record for: OK, unless the target is another volume's or holds
// a mount berth did not make for this volume. A retry after the publish
// record went but the read-only flag could not follow it finishes that.
// rec is nil when the volume has no record.
func (n *nodeServer) unpublishedAlready(rec *volumeRecord, id, target string, tp *heldPath) error {
	if owner, ok := n.a.state.pathOwner(target); ok && owner != id {
		return notFound("volume %q: not published at %q, which belongs to volume %q", id, target, owner)
	}
	if tp != nil {
		_, err := n.a.mountAt(tp)
		switch {
		case err == nil:
			return notFound("volume %q: not published at %q; the mount there was not made by berth for this volume", id, target)
		case !errors.Is(err, errdefs.ErrNotFound):
			return err
		}
	}
	if rec != nil && rec.AccessType == "block" {
		if err := n.syncRecordedReadOnly(rec); err != nil {
			return err
		}
	}
	return nil
}

// unmountTarget unmounts what is mounted at a recorded target and
// removes the target. What is mounted there is berth's bind, even a
// wrong one (made while the staging mount was lost), and is unmounted;
// never a mount of another volume berth knows.
func (n *nodeServer) unmountTarget(ctx context.Context, id, target string, tp *heldPath, unlock *func(), took *stepTimer) error {
	err := n.blocking(ctx, "unmount "+target, unlock, func() error {
		return n.a.host.Unmount(tp.dir, tp.name, func(m mountEntry) error {
			if owner, ok := n.a.mountOwner(m, id); ok {
				return precondition("volume %q: target_path %q shows the device of volume %q; refusing to unmount it", id, target, owner)
			}
			return nil
		})
	})
	if err != nil {
		return err
	}
	took.mark("unmount")
	if err := removeTarget(tp); err != nil {
		return err
	}
	took.mark("remove")
	return nil
}

// forgetPublish drops the publish record of target and, for raw block,
// clears the device's read-only flag when no read-only publish needs it
// any more.
func (n *nodeServer) forgetPublish(rec *volumeRecord, target string, took *stepTimer) error {
	delete(rec.Publishes, target)
	if rec.AccessType == "block" {
		if err := n.syncRecordedReadOnly(rec); err != nil {
			return err
		}
		took.mark("read_only")
	}
	if err := n.a.state.put(rec); err != nil {
		return err
	}
	took.mark("record")
	return nil
}

func rwName(readOnly bool) string {
	if readOnly {
		return "read-only"
	}
	return "read-write"
}

func (r *volumeRecord) publishes() map[string]publishRecord {
	if r == nil {
		return nil
	}
	return r.Publishes
}

// wantDeviceReadOnly reports whether the device of a raw block volume is
// to be read-only at the block layer: while it is published, if its
// access mode is a reader-only one or every publish is read-only. A
// read-write publish next to read-only ones makes the device writable
// through all of them; the block layer has one flag per device.
func (r *volumeRecord) wantDeviceReadOnly() bool {
	if r.AccessType != "block" || len(r.Publishes) == 0 {
		return false
	}
	if r.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY.String() ||
		r.Mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY.String() {
		return true
	}
	for _, p := range r.Publishes {
		if !p.ReadOnly {
			return false
		}
	}
	return true
}

// syncDeviceReadOnly brings the block layer's read-only flag of a raw
// block volume's device in line with its publishes. It clears only a flag
// that berth set: a device the driver holds read-only stays so. What
// berth set is recorded before setting the flag and forgotten only after
// clearing it, so that a crash in between leaves a record from which a
// retried call, or the unstage, clears it. rec is saved when it changes.
// syncRecordedReadOnly is syncDeviceReadOnly for the volume's recorded
// device, when it is still there. With no read-only publish wanted and
// the flag not set there is nothing to do, and the device is not read.
func (n *nodeServer) syncRecordedReadOnly(rec *volumeRecord) error {
	if !rec.wantDeviceReadOnly() && !rec.DeviceReadOnly {
		return nil
	}
	if d := n.a.recordedDevice(rec.volumeDevice()); d != nil {
		return n.syncDeviceReadOnly(rec, d)
	}
	return nil
}

func (n *nodeServer) syncDeviceReadOnly(rec *volumeRecord, dev *devices.Device) error {
	if !rec.wantDeviceReadOnly() {
		if !rec.DeviceReadOnly {
			return nil
		}
		if err := n.a.host.SetDeviceReadOnly(dev.Path, false); err != nil {
			return fmt.Errorf("volume %q: make device %s writable again now that no read-only publish needs it: %w", rec.VolumeID, dev.Path, err)
		}
		rec.DeviceReadOnly = false
		return n.a.state.put(rec)
	}
	if !rec.DeviceReadOnly {
		rec.DeviceReadOnly = true
		if err := n.a.state.put(rec); err != nil {
			return err
		}
	}
	if err := n.a.host.SetDeviceReadOnly(dev.Path, true); err != nil {
		return fmt.Errorf("volume %q: make device %s read-only for a read-only raw block publish (a read-only bind mount of a device node does not stop writes; berth needs CAP_SYS_ADMIN): %w", rec.VolumeID, dev.Path, err)
	}
	ro, err := n.a.host.DeviceReadOnly(dev.Path)
	if err != nil {
		return fmt.Errorf("volume %q: check that device %s is read-only: %w", rec.VolumeID, dev.Path, err)
	}
	if !ro {
		return fmt.Errorf("volume %q: device %s still accepts writes after BLKROSET; refusing a read-only raw block publish", rec.VolumeID, dev.Path)
	}
	return nil
}

// volumePathOf finds the record of a volume and checks that p is its
// staging path or one of its publish targets: only recorded paths are
// ever looked at, so a request cannot make berth stat or resize
// elsewhere.
func (n *nodeServer) volumePathOf(id, p string) (*volumeRecord, error) {
	rec, ok := n.a.state.get(id)
	if !ok {
		return nil, notFound("volume %q: not staged on this node", id)
	}
	if _, published := rec.Publishes[p]; published || (p == rec.StagingPath && rec.Staged) {
		return rec, nil
	}
	return nil, notFound("volume %q: %q is neither its staging path nor a target it is published at", id, p)
}

func (n *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (_ *csi.NodeGetVolumeStatsResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, p := req.GetVolumeId(), req.GetVolumePath()
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if p == "" {
		return nil, invalid("volume_path: missing")
	}
	unlock, err := n.a.locks.tryLock(volumeKey(id))
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := n.volumePathOf(id, p)
	if err != nil {
		return nil, err
	}
	cond := n.a.condition(ctx, rec)
	resp := &csi.NodeGetVolumeStatsResponse{VolumeCondition: cond}
	if rec.AccessType == "block" {
		d := n.a.recordedDevice(rec.volumeDevice())
		if d == nil {
			cond.Abnormal, cond.Message = true, fmt.Sprintf("device %s (or its dm-crypt mapping) is gone or changed since stage", rec.Device.path())
			return resp, nil
		}
		size, err := n.a.host.BlockDeviceSize(d.Path)
		if err != nil {
			return nil, err
		}
		resp.Usage = []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}
		return resp, nil
	}
	unmounted, err := n.a.pathCondition(rec, p)
	if err != nil {
		return nil, err
	}
	if unmounted != nil {
		resp.VolumeCondition = unmounted
		return resp, nil
	}
	st, err := n.a.host.Stats(p)
	if err != nil {
		return nil, err
	}
	resp.Usage = []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: st.TotalBytes, Available: st.AvailableBytes, Used: st.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: st.TotalInodes, Available: st.FreeInodes, Used: st.UsedInodes},
	}
	return resp, nil
}

// condition reports the volume's health: the transport's view of the
// connection, then whether the device is still the one staged and the
// staging mount is in place.
func (a *Agent) condition(ctx context.Context, rec *volumeRecord) *csi.VolumeCondition {
	return a.conditionOf(ctx, rec, a.recordedTarget(rec))
}

// conditionOf is condition with the record's target already parsed (nil
// when it does not parse).
func (a *Agent) conditionOf(ctx context.Context, rec *volumeRecord, t Target) *csi.VolumeCondition {
	if !rec.Staged || rec.Device == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: "staging did not complete; the CO retries NodeStageVolume or calls NodeUnstageVolume"}
	}
	if t != nil {
		if abnormal, msg := t.Health(ctx); abnormal {
			return &csi.VolumeCondition{Abnormal: true, Message: msg}
		}
	}
	d := a.recordedDevice(rec.Device)
	if d == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("device %s is gone or changed since stage", rec.Device.path())}
	}
	if rec.Device.Size > 0 && d.Size < rec.Device.Size {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("device %s shrank from %d to %d bytes: the volume's end is gone", d.Path, rec.Device.Size, d.Size)}
	}
	if rec.Crypt != nil && a.recordedDevice(rec.Crypt.Mapping) == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("dm-crypt mapping %s of device %s is gone or changed since stage", rec.Crypt.Name, d.Path)}
	}
	if rec.AccessType != "block" {
		if err := a.checkStagingMount(rec); err != nil {
			return &csi.VolumeCondition{Abnormal: true, Message: err.Error()}
		}
	}
	return &csi.VolumeCondition{Abnormal: false, Message: "volume is attached and mounted"}
}

// pathCondition is the condition of a mount volume's path (its staging
// path or a publish target) that does not show the volume (a lost mount,
// another mount put there), nil while it does. NodeGetVolumeStats and the
// metrics scrape both use it.
func (a *Agent) pathCondition(rec *volumeRecord, p string) (*csi.VolumeCondition, error) {
	var err error
	if p == rec.StagingPath {
		err = a.checkStagingMount(rec)
	} else {
		var mounted bool
		mounted, err = a.checkPublished(rec, p)
		if err == nil && !mounted {
			err = precondition("volume %q: %s is not mounted", rec.VolumeID, p)
		}
	}
	switch {
	case err == nil:
		return nil, nil
	case errors.Is(err, errdefs.ErrFailedPrecondition):
		return &csi.VolumeCondition{Abnormal: true, Message: err.Error()}, nil
	}
	return nil, err
}

// conditionAt is the condition NodeGetVolumeStats reports for the volume
// at any of paths: conditionOf, then, for a mount volume, whether each path
// still has its mount. An error checking a path makes the volume abnormal.
func (a *Agent) conditionAt(ctx context.Context, rec *volumeRecord, t Target, paths []string) *csi.VolumeCondition {
	c := a.conditionOf(ctx, rec, t)
	if c.Abnormal || rec.AccessType == "block" {
		return c
	}
	for _, p := range paths {
		u, err := a.pathCondition(rec, p)
		if err != nil {
			return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("check the mount at %s: %v", p, err)}
		}
		if u != nil {
			return u
		}
	}
	return c
}

// expandRequest is a NodeExpandVolume request once validated.
type expandRequest struct {
	id, path        string
	required, limit int64
	vcap            *volumeCap // nil: the request has no capability
	secrets         map[string]string
}

// NodeExpandVolume grows a volume after its storage grew: it rescans the
// device, then grows the dm-crypt mapping and the filesystem to it.
func (n *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (_ *csi.NodeExpandVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	er, err := n.validateExpand(req)
	if err != nil {
		return nil, err
	}
	unlock, err := n.a.locks.tryLock(volumeKey(er.id))
	if err != nil {
		return nil, err
	}
	defer unlock()
	took := newStepTimer()
	rec, target, err := n.checkExpand(er)
	if err != nil {
		return nil, err
	}
	took.mark("check")
	size, err := n.rescan(ctx, er, target)
	if err != nil {
		return nil, err
	}
	took.mark("rescan")
	if err := n.checkExpandedSize(er, rec, size); err != nil {
		return nil, err
	}
	if err := n.growVolume(ctx, er, rec, took); err != nil {
		return nil, err
	}
	old := rec.Device.Size
	rec.Device.Size = size
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
	took.mark("record")
	logFrom(ctx, n.a.log).InfoContext(ctx, "expanded", slog.String("device", rec.Device.path()),
		slog.Int64("old_bytes", old), slog.Int64("new_bytes", size), took.attr())
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// validateExpand checks a NodeExpandVolume request before anything is
// locked or touched.
func (n *nodeServer) validateExpand(req *csi.NodeExpandVolumeRequest) (expandRequest, error) {
	e := expandRequest{id: req.GetVolumeId(), path: req.GetVolumePath(), secrets: req.GetSecrets()}
	if err := validateVolumeID(e.id); err != nil {
		return e, err
	}
	if e.path == "" {
		return e, invalid("volume_path: missing")
	}
	e.required, e.limit = req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	switch {
	case e.required < 0 || e.limit < 0:
		return e, invalid("capacity_range: negative size")
	case e.limit > 0 && e.required > e.limit:
		return e, invalid("capacity_range: required_bytes %d exceeds limit_bytes %d", e.required, e.limit)
	}
	if err := validateSecrets(e.secrets); err != nil {
		return e, err
	}
	if c := req.GetVolumeCapability(); c != nil {
		v, err := validateCapability(c, n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions)
		if err != nil {
			return e, err
		}
		e.vcap = &v
	}
	return e, nil
}

// checkExpand finds the volume's record for the volume path, checks it
// against the request, and parses its target. The device must still be
// the one staged and, for a mount volume, the staging mount in place:
// the filesystem is grown through it.
func (n *nodeServer) checkExpand(e expandRequest) (*volumeRecord, Target, error) {
	id := e.id
	rec, err := n.volumePathOf(id, e.path)
	if err != nil {
		return nil, nil, err
	}
	if e.vcap != nil && e.vcap.accessType() != rec.AccessType {
		return nil, nil, invalid("volume_capability: access type %s, the volume was staged as %s", e.vcap.accessType(), rec.AccessType)
	}
	tr, ok := n.a.transports[rec.Transport]
	if !ok {
		return nil, nil, precondition("volume %q: transport %q is not enabled", id, rec.Transport)
	}
	target, err := tr.Parse(rec.Context, e.secrets)
	if err != nil {
		return nil, nil, err
	}
	if n.a.recordedDevice(rec.Device) == nil {
		return nil, nil, precondition("volume %q: its device %s is gone or changed since stage; unstage and stage again", id, rec.Device.path())
	}
	if rec.AccessType != "block" {
		// The filesystem is grown through its staging mount.
		if err := n.a.checkStagingMount(rec); err != nil {
			return nil, nil, err
		}
	}
	return rec, target, nil
}

// rescan has the transport look at the storage's size again (growing the
// device to required_bytes where the transport can) and returns the
// device's size.
func (n *nodeServer) rescan(ctx context.Context, e expandRequest, target Target) (int64, error) {
	if e.required > 0 {
		return target.ExpandTo(ctx, e.required)
	}
	return target.Expand(ctx)
}

// checkExpandedSize checks the device after a rescan: still the volume's
// storage, not smaller than recorded, within the capacity range.
func (n *nodeServer) checkExpandedSize(e expandRequest, rec *volumeRecord, size int64) error {
	id := e.id
	// A rescan reads the storage's identity again: a LUN replaced behind
	// the same number shows only now, and its filesystem is not the
	// volume's to grow.
	if n.a.recordedDevice(rec.Device) == nil {
		return precondition("volume %q: its device %s changed during the rescan (the LUN or namespace was replaced?); nothing was resized: unstage and stage again", id, rec.Device.path())
	}
	if rec.Device.Size > 0 && size < rec.Device.Size {
		// The storage shrank (a LUN or namespace resized on the target):
		// the filesystem is not touched, the operator has to look.
		return precondition("volume %q: device %s shrank from %d to %d bytes; berth never shrinks a filesystem or grows it into a smaller device: restore the storage's size", id, rec.Device.path(), rec.Device.Size, size)
	}
	if e.required > size {
		return fmt.Errorf("volume %q: device %s holds %d bytes after a rescan, %d are required; grow the storage first: %w", id, rec.Device.path(), size, e.required, errdefs.ErrOutOfRange)
	}
	if e.limit > 0 && size > e.limit {
		return fmt.Errorf("volume %q: device %s holds %d bytes, more than limit_bytes %d: %w", id, rec.Device.path(), size, e.limit, errdefs.ErrOutOfRange)
	}
	return nil
}

// growVolume grows the dm-crypt mapping of an encrypted volume and the
// filesystem of a mount volume to the device's new size.
func (n *nodeServer) growVolume(ctx context.Context, e expandRequest, rec *volumeRecord, took *stepTimer) error {
	fsDev := rec.Device.path()
	if rec.Crypt != nil {
		m, err := n.resizeMapping(ctx, rec, e.secrets)
		if err != nil {
			return err
		}
		took.mark("resize_mapping")
		fsDev = m.Path
	}
	if rec.AccessType != "block" {
		if err := n.a.host.Resize(ctx, fsDev, rec.StagingPath, rec.FsType); err != nil {
			return err
		}
		took.mark("resize")
	}
	return nil
}

func (n *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_VOLUME_CONDITION,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (n *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	resp := &csi.NodeGetInfoResponse{
		NodeId:            n.a.cfg.NodeID,
		MaxVolumesPerNode: n.a.cfg.MaxVolumes,
	}
	if len(n.a.cfg.Topology) > 0 {
		resp.AccessibleTopology = &csi.Topology{Segments: n.a.cfg.Topology}
	}
	return resp, nil
}

// recordedDevice looks up the device of a record and returns it only if
// it is still the same device: same numbers, same disk sequence, same
// identity. nil means gone or replaced.
func (a *Agent) recordedDevice(r *deviceRecord) *devices.Device {
	if r == nil {
		return nil
	}
	d, err := a.lookup(r.Name)
	if err != nil || !r.identifies(d) {
		return nil
	}
	return d
}
