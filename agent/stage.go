package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
	berthfs "github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// openStaging resolves the staging path once (no symlink on the way, the
// last element included) and checks that it is an existing directory.
// The stage mounts on, and checks, what was opened here.
func openStaging(p string) (*heldPath, *berthfs.Handle, error) {
	sp, err := holdPath("staging_target_path", p)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil, errdefs.NotFound("staging_target_path %q: does not exist (the CO creates it before NodeStageVolume)", p)
	}
	if err != nil {
		return nil, nil, err
	}
	h, err := sp.open()
	if err == nil {
		var st berthfs.PathStat
		if st, err = h.Stat(); err == nil && !st.Dir {
			err = errdefs.InvalidArgument("staging_target_path %q: not a directory", p)
		}
		if err != nil {
			h.Close()
		}
	}
	switch {
	case err == nil:
		return sp, h, nil
	case errors.Is(err, errdefs.ErrNotFound):
		err = errdefs.NotFound("staging_target_path %q: does not exist (the CO creates it before NodeStageVolume)", p)
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
	ident       string             // the storage's identity, "" when it cannot be looked at now
	mkfs        berthfs.MkfsParams // the geometry of a filesystem the stage makes
	fencing     string             // volume_context "fencing": fenceReserve or fenceNone
	pctx        map[string]string  // publish_context, for a TakeoverAuthority
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

	registered bool // this call registered the node's reservation key (see fenceStage)
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
	if err := n.fenceStage(ctx, s); err != nil {
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
	if !s.vcap.Block {
		if s.mkfs, err = berthfs.ParseMkfsParams(s.vcap.FsType, s.vctx); err != nil {
			return s, err
		}
	}
	if s.fencing, err = parseFencing(s.vctx); err != nil {
		return s, err
	}
	s.pctx = req.GetPublishContext()
	if node, ok := s.pctx[PublishContextNode]; ok && node != n.a.cfg.NodeID {
		// The CO attached the volume to another node (or this node's
		// --node-id is not the name the CO knows it by): staging it here
		// would bypass the CO's one-node check.
		return s, errdefs.FailedPrecondition("volume %q: publish_context %s says the CO attached it to node %q, but this node is %q: stage it on that node, or check that berth serve's --node-id is the node's name in the cluster",
			s.id, PublishContextNode, node, n.a.cfg.NodeID)
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
	var err error
	if s.rec, s.known, err = n.a.state.lookup(s.id); err != nil {
		return err
	}
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
			return errdefs.AlreadyExists("volume %q: staged with %s=%t, the request asks for %t", s.id, ContextEncrypted, s.rec.Crypt != nil, s.enc != nil)
		}
		if s.rec.Fence != nil && s.rec.Fence.Mode != fenceUnavailable && s.rec.optedOut() != (s.fencing == fenceNone) {
			return errdefs.AlreadyExists("volume %q: staged with %s %q, the request asks for %q", s.id, ContextFencing, s.rec.Fence.Mode, s.fencing)
		}
	} else if owner, ok := n.a.state.pathOwner(s.staging); ok {
		return errdefs.AlreadyExists("staging_target_path %q: in use by volume %q", s.staging, owner)
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
		return errdefs.FailedPrecondition("%s target %s: the same storage is already staged on this node as volume %q; unstage it first", s.tr.Name(), what, owner)
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
// NodeUnstageVolume (or a retried stage) finishes from.
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
		if err := n.a.state.put(s.rec); err != nil {
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
		if err := checkUsable(rec, s.staging, m); err != nil {
			return false, err
		}
		// The mount alone does not say the device is alive: a
		// lost controller or a removed LUN leaves a filesystem
		// whose every I/O fails.
		if n.a.recordedDevice(rec.Device) == nil || (rec.Crypt != nil && n.a.recordedDevice(rec.Crypt.Mapping) == nil) {
			return false, errdefs.FailedPrecondition("volume %q: its device %s (or its dm-crypt mapping) is gone (target lost or LUN removed) while its filesystem is mounted at %q; the filesystem is dead: NodeUnstageVolume, then stage again", s.id, rec.Device.path(), s.staging)
		}
		if err := n.stillFenced(s); err != nil {
			return false, err
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
				return errdefs.FailedPrecondition("staging_target_path %q: shows device %d:%d, not the mount just made", s.staging, m.Major, m.Minor)
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
		} else if err := n.undoFence(uctx, s); err != nil {
			errs = append(errs, fmt.Errorf("undo fence: %w", err))
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
			return errdefs.FailedPrecondition("volume %q: %s target %s now leads to other storage (%s: %s): the LUN or namespace was replaced since the volume was staged; berth does not use it as this volume: NodeUnstageVolume, and check the storage",
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
		return errdefs.FailedPrecondition("%s target %s: attached as %s, which is the device of volume %q, already staged on this node; unstage it first", s.tr.Name(), s.target.Key(), describeDevice(dev), owner)
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
		return errdefs.FailedPrecondition("staging_target_path %q: holds a mount of device %d:%d (%s), not of the volume's device %s", s.staging, m.Major, m.Minor, m.FSType, s.vdev.Path)
	case !errors.Is(err, errdefs.ErrNotFound):
		return err
	}
	if err := n.prepareFilesystem(ctx, s); err != nil {
		return err
	}
	return n.mountFilesystem(s)
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

// compatibleStage checks a repeated stage against the recorded one.
func compatibleStage(rec *volumeRecord, staging, transport, key string, c volumeCap) error {
	id := rec.VolumeID
	switch {
	case rec.StagingPath != staging:
		return errdefs.FailedPrecondition("volume %q: already staged at %q; unstage it there first", id, rec.StagingPath)
	case rec.Transport != transport || rec.TargetKey != key:
		return errdefs.AlreadyExists("volume %q: staged from %s target %s, the request names %s target %s", id, rec.Transport, rec.TargetKey, transport, key)
	case rec.AccessType != c.accessType():
		return errdefs.AlreadyExists("volume %q: staged with access type %s, the request asks for %s", id, rec.AccessType, c.accessType())
	case rec.FsType != c.FsType:
		return errdefs.AlreadyExists("volume %q: staged with fs_type %s, the request asks for %s", id, rec.FsType, c.FsType)
	case rec.Mode != c.Mode.String():
		return errdefs.AlreadyExists("volume %q: staged with access mode %s, the request asks for %s", id, rec.Mode, c.Mode)
	case !slices.Equal(rec.MountFlags, c.MountFlags):
		return errdefs.AlreadyExists("volume %q: staged with mount_flags %q, the request has %q", id, rec.MountFlags, c.MountFlags)
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
