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

func (n *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (_ *csi.NodeStageVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if err := validatePath("staging_target_path", staging); err != nil {
		return nil, err
	}
	vcap, err := validateCapability(req.GetVolumeCapability(), n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions)
	if err != nil {
		return nil, err
	}
	vctx, err := mergeContext(req.GetVolumeContext(), req.GetPublishContext())
	if err != nil {
		return nil, err
	}
	if err := validateSecrets(req.GetSecrets()); err != nil {
		return nil, err
	}
	enc, err := parseEncryption(vctx)
	if err != nil {
		return nil, err
	}
	var passphrase []byte
	if enc != nil {
		if passphrase, err = passphraseOf(req.GetSecrets()); err != nil {
			return nil, err
		}
	}
	tr, err := selectTransport(vctx, n.a.implied, n.a.transports)
	if err != nil {
		return nil, err
	}
	target, err := tr.Parse(vctx, req.GetSecrets())
	if err != nil {
		return nil, err
	}
	// The storage's identity, when it can be looked at now: an image that
	// is gone fails the attach below with its own error.
	ident, err := target.Identity()
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	// Two volumes naming one storage object are staged one at a time, so
	// that the second finds the first's record.
	locks := []string{volumeKey(id), pathKey(staging), storageKey(tr.Name(), target.Key())}
	if ident != "" {
		locks = append(locks, storageKey(tr.Name(), ident))
	}
	unlock, err := n.a.locks.tryLock(locks...)
	if err != nil {
		return nil, err
	}
	defer unlock()
	sp, sh, err := openStaging(staging)
	if err != nil {
		return nil, err
	}
	defer sp.close()
	defer sh.Close()
	log := logFrom(ctx, n.a.log)
	took := newStepTimer()

	rec, known := n.a.state.get(id)
	if !known || !rec.Staged {
		// Before the intent record: a node that cannot attach the
		// target at all keeps nothing that would need unstaging.
		if err := target.Preflight(ctx); err != nil {
			return nil, err
		}
		if enc != nil {
			if err := n.a.crypt.Check(); err != nil {
				return nil, fmt.Errorf("volume %q: encrypted: %w", id, err)
			}
		}
	}
	if known {
		if err := compatibleStage(rec, staging, tr.Name(), target.Key(), vcap); err != nil {
			return nil, err
		}
		if (rec.Crypt != nil) != (enc != nil) {
			return nil, alreadyExists("volume %q: staged with %s=%t, the request asks for %t", id, ContextEncrypted, rec.Crypt != nil, enc != nil)
		}
	} else if owner, ok := n.a.state.pathOwner(staging); ok {
		return nil, alreadyExists("staging_target_path %q: in use by volume %q", staging, owner)
	}
	// One storage object is staged once per node: two volumes writing
	// one filesystem through two devices corrupt it. This is checked
	// before anything is attached, and a refusal undoes nothing (undoing
	// would detach what the other volume uses).
	if owner, ok := n.storageOwner(id, tr, target.Key(), ident); ok {
		what := target.Key()
		if ident != "" && ident != what {
			what += " (" + ident + ")"
		}
		return nil, precondition("%s target %s: the same storage is already staged on this node as volume %q; unstage it first", tr.Name(), what, owner)
	}
	if !known {
		if max := n.a.cfg.MaxVolumes; max > 0 && int64(n.a.state.count()) >= max {
			return nil, fmt.Errorf("node %s already has %d volumes, its limit (--max-volumes): %w", n.a.cfg.NodeID, max, errdefs.ErrResourceExhausted)
		}
		rec = &volumeRecord{
			VolumeID:    id,
			Transport:   tr.Name(),
			Context:     withoutSecrets(vctx, req.GetSecrets()),
			TargetKey:   target.Key(),
			TargetID:    ident,
			AccessType:  vcap.accessType(),
			FsType:      vcap.FsType,
			MountFlags:  vcap.MountFlags,
			Mode:        vcap.Mode.String(),
			StagingPath: staging,
		}
		if enc != nil {
			rec.Crypt = &cryptRecord{Name: mappingName(id)}
		}
		// Intent first: a crash after Attach leaves a record that
		// NodeUnstageVolume (or a retried stage) finishes from.
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
	}
	if ident != "" {
		rec.TargetID = ident
	}
	wasStaged := rec.Staged

	// Fast path of a repeated call: the staging mount is in place.
	if wasStaged && !vcap.Block {
		m, err := n.a.host.MountInfo(sh)
		switch {
		case err == nil:
			if err := checkStagingEntry(rec, m); err != nil {
				return nil, err
			}
			// The mount alone does not say the device is alive: a
			// lost controller or a removed LUN leaves a filesystem
			// whose every I/O fails.
			if n.a.recordedDevice(rec.Device) == nil || (rec.Crypt != nil && n.a.recordedDevice(rec.Crypt.Mapping) == nil) {
				return nil, precondition("volume %q: its device %s (or its dm-crypt mapping) is gone (target lost or LUN removed) while its filesystem is mounted at %q; the filesystem is dead: NodeUnstageVolume, then stage again", id, rec.Device.Path, staging)
			}
			return &csi.NodeStageVolumeResponse{}, nil
		case !errors.Is(err, errdefs.ErrNotFound):
			return nil, err
		}
		log.WarnContext(ctx, "staged volume is no longer mounted; staging it again")
	}

	var mounted bool
	defer func() {
		if retErr == nil {
			return
		}
		var errs []error
		if mounted {
			// Only the volume's own mount, the one made above.
			errs = append(errs, n.a.host.Unmount(sp.dir, sp.name, func(m mountEntry) error {
				if !sameDevice(m, rec.volumeDevice()) {
					return precondition("staging_target_path %q: shows device %d:%d, not the mount just made", staging, m.Major, m.Minor)
				}
				return nil
			}))
		}
		// A format that started and failed has changed the device: it
		// stays attached with its record, which says so, for the retry
		// to finish (or the unstage to undo).
		if !wasStaged && rec.Formatting == nil && (rec.Crypt == nil || rec.Crypt.Formatting == nil) {
			uctx, cancel := n.a.undoContext(ctx)
			defer cancel()
			if err := n.closeMapping(uctx, rec); err != nil {
				errs = append(errs, fmt.Errorf("undo open: %w", err))
			} else if err := n.detach(uctx, rec, tr, target); err != nil {
				errs = append(errs, fmt.Errorf("undo attach: %w", err))
			} else if err := n.a.state.remove(id); err != nil {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			log.ErrorContext(ctx, "undoing a failed stage left work behind; NodeUnstageVolume retries it", slog.String("error", err.Error()))
		}
	}()

	took.mark("prepare")
	dev, err := target.Attach(ctx)
	if err != nil {
		return nil, err
	}
	took.mark("attach")
	log = log.With(slog.String("device", dev.Path))
	if wasStaged && rec.Device != nil && (rec.Device.Major != dev.Major || rec.Device.Minor != dev.Minor) {
		log.InfoContext(ctx, "volume came back on another device", slog.String("old_device", rec.Device.Path))
	}
	// The volume_context may name the storage by a number only (a LUN, a
	// namespace ID): storage put behind that number since the device was
	// recorded is another volume's, or blank, and is neither mounted nor
	// formatted as this one.
	if rec.Device != nil {
		if change := rec.Device.storageChange(dev); change != "" {
			return nil, precondition("volume %q: %s target %s now leads to other storage (%s: %s): the LUN or namespace was replaced since the volume was staged; berth does not use it as this volume: NodeUnstageVolume, and check the storage",
				id, tr.Name(), target.Key(), dev.Path, change)
		}
	}
	// (In memory: the undo of a refusal below sees the device and leaves
	// it to its owner.)
	rec.Device = deviceRecordOf(dev)
	// Names the identity check cannot tell apart (a LUN exported under
	// two target names, a namespace given by NSID here and by UUID
	// there) show once attached: the device is another volume's.
	if owner, ok := n.deviceOwner(id, rec.Device); ok {
		return nil, precondition("%s target %s: attached as %s, which is the device of volume %q, already staged on this node; unstage it first", tr.Name(), target.Key(), describeDevice(dev), owner)
	}
	// vdev is the device that holds the filesystem or is published: the
	// dm-crypt mapping of an encrypted volume.
	vdev, freshFS := dev, false
	if enc != nil {
		m, fresh, err := n.openEncrypted(ctx, rec, dev, *enc, passphrase, wasStaged)
		if err != nil {
			return nil, err
		}
		took.mark("open")
		rec.Crypt.Mapping = deviceRecordOf(m)
		if fresh && vcap.Block {
			rec.Crypt.Formatting = nil // nothing more to make
		}
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
		vdev, freshFS = m, fresh && !vcap.Block
		log = log.With(slog.String("mapping", m.ID.DMName))
	}
	if vcap.Block {
		// Raw block: the device is published directly, nothing is
		// mounted at the staging path. A stage repeated after a crash
		// or on a new device brings the read-only flag in line with the
		// recorded publishes; the device is recorded before its flag
		// is touched.
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
		if err := n.syncDeviceReadOnly(rec, vdev); err != nil {
			return nil, err
		}
		rec.Staged = true
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
		took.mark("record")
		log.InfoContext(ctx, "staged for raw block access", took.attr())
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if err := n.a.verify(dev); err != nil {
		return nil, err
	}
	if vdev != dev {
		if err := n.a.verify(vdev); err != nil {
			return nil, err
		}
	}
	took.mark("verify")

	m, err := n.a.host.MountInfo(sh)
	switch {
	case err == nil && sameDevice(m, rec.volumeDevice()):
		// A previous attempt mounted it and crashed before recording.
		if err := checkStagingEntry(rec, m); err != nil {
			return nil, err
		}
		rec.StagingRootIno = m.Ino
	case err == nil:
		return nil, precondition("staging_target_path %q: holds a mount of device %d:%d (%s), not of the volume's device %s", staging, m.Major, m.Minor, m.FSType, vdev.Path)
	case !errors.Is(err, errdefs.ErrNotFound):
		return nil, err
	default:
		var formatted bool
		if freshFS {
			// A new LUKS device: its mapping reads as noise, which no
			// probe calls blank; the blank underlying device was the
			// proof, and the record says the format is berth's.
			if err := n.a.host.Format(ctx, vdev.Path, vcap.FsType); err != nil {
				return nil, err
			}
			rec.Crypt.Formatting = nil
			if err := n.a.state.put(rec); err != nil {
				return nil, err
			}
			formatted = true
		} else if formatted, err = n.ensureFilesystem(ctx, rec, vdev, vcap.FsType); err != nil {
			if errors.Is(err, berthfs.ErrLUKSDevice) && enc == nil {
				err = fmt.Errorf("volume %q: %w; it is staged only as an encrypted volume: volume_context %s=\"true\" and its passphrase in node_stage_secrets %q",
					id, err, ContextEncrypted, SecretEncryptionPassphrase)
			}
			return nil, err
		}
		if formatted {
			took.mark("format")
			log.InfoContext(ctx, "created filesystem", slog.String("fs_type", vcap.FsType))
		} else {
			took.mark("probe")
			if err := n.a.host.Fsck(ctx, dev.Path, vcap.FsType); err != nil {
				return nil, err
			}
			took.mark("fsck")
		}
		// mkfs and fsck take time; make sure the name still means the
		// device we checked before mounting it.
		if err := n.a.verify(vdev); err != nil {
			return nil, err
		}
		took.mark("verify_again")
		flags, data, err := n.mountOptions(vcap, vcap.readOnly())
		if err != nil {
			return nil, err
		}
		if err := n.a.host.Mount(vdev.Path, sh, vcap.FsType, flags, xfsNoUUID(vcap.FsType, data)); err != nil {
			return nil, err
		}
		mounted = true
		took.mark("mount")
		root, err := n.a.mountAt(sp)
		if err != nil {
			return nil, fmt.Errorf("staging_target_path %q: check the new mount: %w", staging, err)
		}
		if !sameDevice(root, rec.volumeDevice()) {
			return nil, fmt.Errorf("staging_target_path %q: after mounting %s it shows device %d:%d", staging, vdev.Path, root.Major, root.Minor)
		}
		// The inode of the filesystem's root: later checks tell the
		// volume's root from a directory inside it by it.
		rec.StagingRootIno = root.Ino
	}
	// A mounted volume's device is recorded with the finished stage:
	// undoing an interrupted one needs only the staging path and the
	// target, both recorded before the attach.
	rec.Staged = true
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
	took.mark("record")
	log.InfoContext(ctx, "staged", slog.String("fs_type", vcap.FsType), took.attr())
	return &csi.NodeStageVolumeResponse{}, nil
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
// the same identity looked at now.
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
		t, err := tr.Parse(r.Context, nil)
		if err != nil {
			continue
		}
		if cur, err := t.Identity(); err == nil && cur == ident {
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
	// The CO unpublishes before it unstages. A volume still mounted in a
	// pod is refused rather than torn out from under it; a publish record
	// whose mount is gone is stale and dropped.
	for target := range rec.Publishes {
		if err := n.dropStalePublish(ctx, rec, target); err != nil {
			return nil, err
		}
	}
	took.mark("publishes")
	tr, ok := n.a.transports[rec.Transport]
	if !ok {
		return nil, precondition("volume %q: staged through transport %q, which is not enabled any more; enable it to unstage", id, rec.Transport)
	}
	target, err := tr.Parse(rec.Context, nil)
	if err != nil {
		return nil, fmt.Errorf("volume %q: recorded volume_context: %w", id, err)
	}
	// A device none of whose paths works may queue I/O until one comes
	// back: it is made to fail I/O first, so that the unmount's
	// writeback and the flush below end. What they could not write is
	// lost either way.
	var unreachable bool
	err = n.blocking(ctx, "stop queueing I/O of the volume's device", &unlock, func() error {
		u, err := target.StopQueueing(ctx)
		unreachable = u
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("volume %q: %w", id, err)
	}
	if unreachable {
		log.WarnContext(ctx, "no path to the storage works: the device fails I/O; data not yet written is lost")
	}
	if rec.AccessType != "block" {
		if err := n.blocking(ctx, fmt.Sprintf("unmount %s", rec.StagingPath), &unlock, func() error { return n.unmountStaging(rec) }); err != nil {
			return nil, err
		}
		took.mark("unmount")
	}
	if d := n.a.recordedDevice(rec.volumeDevice()); d != nil {
		// No publish is left: a flag berth set is cleared, so that the
		// next user of the device finds it writable.
		if err := n.syncDeviceReadOnly(rec, d); err != nil {
			return nil, err
		}
		// A device that fails I/O could only fail the flush.
		if !unreachable {
			if err := n.blocking(ctx, "flush "+d.Path, &unlock, func() error { return n.a.host.FlushBuffers(d.Path) }); err != nil {
				return nil, err
			}
		}
		took.mark("flush")
	}
	if rec.Crypt != nil {
		if err := n.blocking(ctx, "close the dm-crypt mapping", &unlock, func() error { return n.closeMapping(ctx, rec) }); err != nil {
			return nil, err
		}
		took.mark("close")
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
		log = log.With(slog.String("device", rec.Device.Path))
	}
	log.InfoContext(ctx, "unstaged", took.attr())
	return &csi.NodeUnstageVolumeResponse{}, nil
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

func (n *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (_ *csi.NodePublishVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if err := validatePath("target_path", target); err != nil {
		return nil, err
	}
	vcap, err := validateCapability(req.GetVolumeCapability(), n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions)
	if err != nil {
		return nil, err
	}
	if staging == "" {
		return nil, precondition("staging_target_path: missing; berth has the STAGE_UNSTAGE_VOLUME capability and publishes staged volumes only")
	}
	if err := validatePath("staging_target_path", staging); err != nil {
		return nil, err
	}
	if staging == target {
		return nil, invalid("target_path: equal to staging_target_path")
	}
	if _, err := mergeContext(req.GetVolumeContext(), req.GetPublishContext()); err != nil {
		return nil, err
	}
	if err := validateSecrets(req.GetSecrets()); err != nil {
		return nil, err
	}
	readOnly := req.GetReadonly() || vcap.readOnly()
	unlock, err := n.a.locks.tryLock(volumeKey(id), pathKey(target))
	if err != nil {
		return nil, err
	}
	defer unlock()
	took := newStepTimer()
	tp, err := holdPath("target_path", target)
	if err != nil {
		return nil, err
	}
	defer tp.close()

	rec, ok := n.a.state.get(id)
	switch {
	case !ok || !rec.Staged:
		return nil, precondition("volume %q: not staged on this node; NodeStageVolume first", id)
	case rec.StagingPath != staging:
		return nil, precondition("volume %q: staged at %q, not at %q", id, rec.StagingPath, staging)
	case rec.AccessType != vcap.accessType():
		return nil, precondition("volume %q: staged with access type %s, publish asks for %s", id, rec.AccessType, vcap.accessType())
	case rec.FsType != vcap.FsType:
		return nil, precondition("volume %q: staged with fs_type %s, publish asks for %s", id, rec.FsType, vcap.FsType)
	}
	if owner, ok := n.a.state.pathOwner(target); ok && owner != id {
		return nil, alreadyExists("target_path %q: in use by volume %q", target, owner)
	}
	if err := n.a.checkTargetOutsideStaging(tp); err != nil {
		return nil, err
	}
	var source *berthfs.Handle
	if !vcap.Block {
		// Binding a staging path that lost its mount would publish a
		// directory of the node's root filesystem. What is bound is
		// the descriptor checked here.
		if source, err = n.a.openStagingMount(rec); err != nil {
			return nil, err
		}
		defer source.Close()
		// The staging mount outlives its device (a lost controller, a
		// LUN removed or replaced): its filesystem fails every I/O and
		// is not given to a pod.
		if n.a.recordedDevice(rec.Device) == nil || n.a.recordedDevice(rec.volumeDevice()) == nil {
			return nil, precondition("volume %q: its device %s is gone or changed since stage (target lost, LUN or namespace removed or replaced) while its filesystem is mounted at %q; the filesystem is dead: NodeUnstageVolume, then stage again", id, rec.Device.Path, staging)
		}
	}
	want := publishRecord{ReadOnly: readOnly, Mode: vcap.Mode.String(), MountFlags: vcap.MountFlags}
	if have, ok := rec.Publishes[target]; ok {
		if have.ReadOnly != want.ReadOnly || have.Mode != want.Mode || !slices.Equal(have.MountFlags, want.MountFlags) {
			return nil, alreadyExists("volume %q: published at %q with readonly=%t mode=%s mount_flags=%q; the request has readonly=%t mode=%s mount_flags=%q",
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
			return nil, err
		}
		if mounted {
			if vcap.Block {
				if err := n.syncRecordedReadOnly(rec); err != nil {
					return nil, err
				}
			}
			return &csi.NodePublishVolumeResponse{}, nil
		}
		// Recorded but not mounted: an interrupted publish; finish it.
	} else {
		single := vcap.singleWriter()
		for other, p := range rec.Publishes {
			if single || p.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER.String() {
				return nil, precondition("volume %q: access mode SINGLE_NODE_SINGLE_WRITER allows one target and it is published at %q", id, other)
			}
			if vcap.Block && !vcap.readOnly() && p.ReadOnly != want.ReadOnly {
				// The block layer has one read-only flag per device:
				// read-only and read-write raw block publishes of one
				// volume cannot both be what they say.
				return nil, precondition("volume %q: published %s at %q; a raw block device is read-only for all its publishes or for none, so a %s publish beside it is refused: unpublish it first",
					id, rwName(p.ReadOnly), other, rwName(want.ReadOnly))
			}
		}
		_, err := n.a.mountAt(tp)
		switch {
		case err == nil:
			return nil, alreadyExists("target_path %q: already a mount point that berth did not make for volume %q", target, id)
		case !errors.Is(err, errdefs.ErrNotFound):
			return nil, err
		}
		rec.Publishes[target] = want
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
	}

	var (
		created bool
		dev     *devices.Device // raw block only
	)
	defer func() {
		if retErr == nil {
			return
		}
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
	}()

	if vcap.Block {
		d := n.a.recordedDevice(rec.volumeDevice())
		if d == nil || n.a.recordedDevice(rec.Device) == nil {
			return nil, precondition("volume %q: its device %s (or its dm-crypt mapping) is gone or changed since stage; unstage and stage again", id, rec.Device.Path)
		}
		if source, err = n.a.host.OpenDeviceNode(d.Path, d.Major, d.Minor); err != nil {
			return nil, err
		}
		defer source.Close()
		// A read-only bind mount does not stop writes through a device
		// node: the block layer's flag must, before the pod sees it.
		dev = d
	}
	took.mark("check")
	th, created, err := prepareTarget(tp, vcap.Block)
	if err != nil {
		return nil, err
	}
	defer th.Close()
	took.mark("target")
	if dev != nil {
		if err := n.syncDeviceReadOnly(rec, dev); err != nil {
			return nil, err
		}
		took.mark("read_only")
	}
	flags, _, err := n.mountOptions(vcap, false)
	if err != nil {
		return nil, err
	}
	if err := n.a.host.BindMount(source, th, readOnly, flags); err != nil {
		return nil, err
	}
	took.mark("bind")
	logFrom(ctx, n.a.log).InfoContext(ctx, "published", slog.Bool("read_only", readOnly), took.attr())
	return &csi.NodePublishVolumeResponse{}, nil
}

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
	tp, err := holdPath("target_path", target)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		// The target's directory is gone, and whatever was mounted in
		// it.
		tp = nil
	case err != nil:
		return nil, err
	default:
		// Closed with the locks: by a step left blocked in the kernel
		// when it ends (see blocking).
		held, release := tp, unlock
		unlock = func() { held.close(); release() }
	}
	if !ok || !published {
		if owner, ok := n.a.state.pathOwner(target); ok && owner != id {
			return nil, notFound("volume %q: not published at %q, which belongs to volume %q", id, target, owner)
		}
		if tp != nil {
			_, err := n.a.mountAt(tp)
			switch {
			case err == nil:
				return nil, notFound("volume %q: not published at %q; the mount there was not made by berth for this volume", id, target)
			case !errors.Is(err, errdefs.ErrNotFound):
				return nil, err
			}
		}
		// A retry after the publish record went but the read-only flag
		// could not follow it finishes that.
		if ok && rec.AccessType == "block" {
			if err := n.syncRecordedReadOnly(rec); err != nil {
				return nil, err
			}
		}
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if tp != nil {
		// What is mounted at a recorded target is berth's bind, even
		// a wrong one (made while the staging mount was lost), and is
		// unmounted; never a mount of another volume berth knows.
		err := n.blocking(ctx, "unmount "+target, &unlock, func() error {
			return n.a.host.Unmount(tp.dir, tp.name, func(m mountEntry) error {
				if owner, ok := n.a.mountOwner(m, id); ok {
					return precondition("volume %q: target_path %q shows the device of volume %q; refusing to unmount it", id, target, owner)
				}
				return nil
			})
		})
		if err != nil {
			return nil, err
		}
		took.mark("unmount")
		if err := removeTarget(tp); err != nil {
			return nil, err
		}
		took.mark("remove")
	}
	delete(rec.Publishes, target)
	if rec.AccessType == "block" {
		if err := n.syncRecordedReadOnly(rec); err != nil {
			return nil, err
		}
		took.mark("read_only")
	}
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
	took.mark("record")
	logFrom(ctx, n.a.log).InfoContext(ctx, "unpublished", took.attr())
	return &csi.NodeUnpublishVolumeResponse{}, nil
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
			cond.Abnormal, cond.Message = true, fmt.Sprintf("device %s (or its dm-crypt mapping) is gone or changed since stage", rec.Device.Path)
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
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("device %s is gone or changed since stage", rec.Device.Path)}
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

func (n *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (_ *csi.NodeExpandVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	id, p := req.GetVolumeId(), req.GetVolumePath()
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if p == "" {
		return nil, invalid("volume_path: missing")
	}
	required, limit := req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	switch {
	case required < 0 || limit < 0:
		return nil, invalid("capacity_range: negative size")
	case limit > 0 && required > limit:
		return nil, invalid("capacity_range: required_bytes %d exceeds limit_bytes %d", required, limit)
	}
	if err := validateSecrets(req.GetSecrets()); err != nil {
		return nil, err
	}
	var vcap *volumeCap
	if c := req.GetVolumeCapability(); c != nil {
		v, err := validateCapability(c, n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions)
		if err != nil {
			return nil, err
		}
		vcap = &v
	}
	unlock, err := n.a.locks.tryLock(volumeKey(id))
	if err != nil {
		return nil, err
	}
	defer unlock()
	took := newStepTimer()
	rec, err := n.volumePathOf(id, p)
	if err != nil {
		return nil, err
	}
	if vcap != nil && vcap.accessType() != rec.AccessType {
		return nil, invalid("volume_capability: access type %s, the volume was staged as %s", vcap.accessType(), rec.AccessType)
	}
	tr, ok := n.a.transports[rec.Transport]
	if !ok {
		return nil, precondition("volume %q: transport %q is not enabled", id, rec.Transport)
	}
	target, err := tr.Parse(rec.Context, req.GetSecrets())
	if err != nil {
		return nil, err
	}
	if n.a.recordedDevice(rec.Device) == nil {
		return nil, precondition("volume %q: its device %s is gone or changed since stage; unstage and stage again", id, rec.Device.Path)
	}
	if rec.AccessType != "block" {
		// The filesystem is grown through its staging mount.
		if err := n.a.checkStagingMount(rec); err != nil {
			return nil, err
		}
	}
	took.mark("check")
	var size int64
	if required > 0 {
		size, err = target.ExpandTo(ctx, required)
	} else {
		size, err = target.Expand(ctx)
	}
	if err != nil {
		return nil, err
	}
	took.mark("rescan")
	// A rescan reads the storage's identity again: a LUN replaced behind
	// the same number shows only now, and its filesystem is not the
	// volume's to grow.
	if n.a.recordedDevice(rec.Device) == nil {
		return nil, precondition("volume %q: its device %s changed during the rescan (the LUN or namespace was replaced?); nothing was resized: unstage and stage again", id, rec.Device.Path)
	}
	if rec.Device.Size > 0 && size < rec.Device.Size {
		// The storage shrank (a LUN or namespace resized on the target):
		// the filesystem is not touched, the operator has to look.
		return nil, precondition("volume %q: device %s shrank from %d to %d bytes; berth never shrinks a filesystem or grows it into a smaller device: restore the storage's size", id, rec.Device.Path, rec.Device.Size, size)
	}
	if required > size {
		return nil, fmt.Errorf("volume %q: device %s holds %d bytes after a rescan, %d are required; grow the storage first: %w", id, rec.Device.Path, size, required, errdefs.ErrOutOfRange)
	}
	if limit > 0 && size > limit {
		return nil, fmt.Errorf("volume %q: device %s holds %d bytes, more than limit_bytes %d: %w", id, rec.Device.Path, size, limit, errdefs.ErrOutOfRange)
	}
	fsDev := rec.Device.Path
	if rec.Crypt != nil {
		m, err := n.resizeMapping(ctx, rec, req.GetSecrets())
		if err != nil {
			return nil, err
		}
		took.mark("resize_mapping")
		fsDev = m.Path
	}
	if rec.AccessType != "block" {
		if err := n.a.host.Resize(ctx, fsDev, rec.StagingPath, rec.FsType); err != nil {
			return nil, err
		}
		took.mark("resize")
	}
	old := rec.Device.Size
	rec.Device.Size = size
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
	took.mark("record")
	logFrom(ctx, n.a.log).InfoContext(ctx, "expanded", slog.String("device", rec.Device.Path),
		slog.Int64("old_bytes", old), slog.Int64("new_bytes", size), took.attr())
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
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
