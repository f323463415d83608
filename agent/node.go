package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"slices"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
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

// stagingDir checks that the staging path is an existing directory.
func stagingDir(p string) error {
	fi, err := os.Stat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return notFound("staging_target_path %q: does not exist (the CO creates it)", p)
	case err != nil:
		return fmt.Errorf("staging_target_path %q: %w", p, err)
	case !fi.IsDir():
		return invalid("staging_target_path %q: not a directory", p)
	}
	return nil
}

// sameDevice reports whether a mount is of the recorded device.
func sameDevice(m mountEntry, d *deviceRecord) bool {
	return d != nil && uint32(m.Major) == d.Major && uint32(m.Minor) == d.Minor
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
	tr, err := selectTransport(vctx, n.a.transports)
	if err != nil {
		return nil, err
	}
	target, err := tr.Parse(vctx, req.GetSecrets())
	if err != nil {
		return nil, err
	}
	unlock, err := n.a.locks.tryLock(volumeKey(id), pathKey(staging))
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := checkPathResolves("staging_target_path", staging); err != nil {
		return nil, err
	}
	if err := stagingDir(staging); err != nil {
		return nil, err
	}
	log := logFrom(ctx, n.a.log)
	took := newStepTimer()

	rec, known := n.a.state.get(id)
	if known {
		if err := compatibleStage(rec, staging, tr.Name(), target.Key(), vcap); err != nil {
			return nil, err
		}
	} else {
		if owner, ok := n.a.state.pathOwner(staging); ok {
			return nil, alreadyExists("staging_target_path %q: in use by volume %q", staging, owner)
		}
		if owner, ok := n.a.state.targetOwner(tr.Name(), target.Key()); ok {
			return nil, precondition("%s target %s: already staged on this node as volume %q", tr.Name(), target.Key(), owner)
		}
		if max := n.a.cfg.MaxVolumes; max > 0 && int64(n.a.state.count()) >= max {
			return nil, fmt.Errorf("node %s already has %d volumes, its limit (--max-volumes): %w", n.a.cfg.NodeID, max, errdefs.ErrResourceExhausted)
		}
		rec = &volumeRecord{
			VolumeID:    id,
			Transport:   tr.Name(),
			Context:     withoutSecrets(vctx, req.GetSecrets()),
			TargetKey:   target.Key(),
			AccessType:  vcap.accessType(),
			FsType:      vcap.FsType,
			MountFlags:  vcap.MountFlags,
			Mode:        vcap.Mode.String(),
			StagingPath: staging,
		}
		// Intent first: a crash after Attach leaves a record that
		// NodeUnstageVolume (or a retried stage) finishes from.
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
	}
	wasStaged := rec.Staged

	// Fast path of a repeated call: the staging mount is in place.
	if wasStaged && !vcap.Block {
		m, err := n.a.host.MountInfo(staging)
		switch {
		case err == nil && sameDevice(m, rec.Device):
			if m.FSType != rec.FsType {
				return nil, precondition("staging_target_path %q: mounted as %s, the volume was staged as %s", staging, m.FSType, rec.FsType)
			}
			return &csi.NodeStageVolumeResponse{}, nil
		case err == nil:
			return nil, precondition("staging_target_path %q: holds a mount of %s (%d:%d), not of the volume's device %s", staging, m.Source, m.Major, m.Minor, rec.Device.Path)
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
			errs = append(errs, n.a.host.Unmount(staging))
		}
		if !wasStaged {
			uctx, cancel := n.a.undoContext(ctx)
			defer cancel()
			if err := target.Detach(uctx); err != nil {
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
	rec.Device = deviceRecordOf(dev)
	if vcap.Block {
		// Raw block: the device is published directly, nothing is
		// mounted at the staging path. A stage repeated after a crash
		// or on a new device brings the read-only flag in line with the
		// recorded publishes; the device is recorded before its flag
		// is touched.
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
		if err := n.syncDeviceReadOnly(rec, dev); err != nil {
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
	took.mark("verify")

	m, err := n.a.host.MountInfo(staging)
	switch {
	case err == nil && sameDevice(m, rec.Device):
		// A previous attempt mounted it and crashed before recording.
	case err == nil:
		return nil, precondition("staging_target_path %q: holds a mount of %s (%d:%d), not of the volume's device %s", staging, m.Source, m.Major, m.Minor, dev.Path)
	case !errors.Is(err, errdefs.ErrNotFound):
		return nil, err
	default:
		formatted, err := n.a.host.EnsureFilesystem(ctx, dev.Path, vcap.FsType)
		if err != nil {
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
		if err := n.a.verify(dev); err != nil {
			return nil, err
		}
		took.mark("verify_again")
		flags, data, err := n.mountOptions(vcap, vcap.readOnly())
		if err != nil {
			return nil, err
		}
		if err := n.a.host.Mount(dev.Path, staging, vcap.FsType, flags, data); err != nil {
			return nil, err
		}
		mounted = true
		took.mark("mount")
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
	defer unlock()
	log := logFrom(ctx, n.a.log)

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
		mounted, err := n.a.host.IsMountPoint(target)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("check publish target %q: %w", target, err)
		}
		if mounted {
			return nil, precondition("volume %q: still published at %q; NodeUnpublishVolume first", id, target)
		}
		if err := removeTarget(target); err != nil {
			// A stale record must not block the unstage the CO asks
			// for; the path is left for the operator.
			log.WarnContext(ctx, "stale publish target not removed", slog.String("target_path", target), slog.String("error", err.Error()))
		}
		delete(rec.Publishes, target)
		if err := n.a.state.put(rec); err != nil {
			return nil, err
		}
	}
	if rec.AccessType != "block" {
		if err := n.a.host.Unmount(staging); err != nil {
			return nil, err
		}
	}
	if d := n.a.recordedDevice(rec.Device); d != nil {
		// No publish is left: a flag berth set is cleared, so that the
		// next user of the device finds it writable.
		if err := n.syncDeviceReadOnly(rec, d); err != nil {
			return nil, err
		}
		if err := n.a.host.FlushBuffers(d.Path); err != nil {
			return nil, err
		}
	}
	tr, ok := n.a.transports[rec.Transport]
	if !ok {
		return nil, precondition("volume %q: staged through transport %q, which is not enabled any more; enable it to unstage", id, rec.Transport)
	}
	target, err := tr.Parse(rec.Context, nil)
	if err != nil {
		return nil, fmt.Errorf("volume %q: recorded volume_context: %w", id, err)
	}
	if err := target.Detach(ctx); err != nil {
		return nil, err
	}
	if err := n.a.state.remove(id); err != nil {
		return nil, err
	}
	if rec.Device != nil {
		log.InfoContext(ctx, "detached", slog.String("device", rec.Device.Path))
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// removeTarget removes a publish target berth created: an empty directory
// or a file. A missing path is fine.
func removeTarget(p string) error {
	err := os.Remove(p)
	switch {
	case err == nil, errors.Is(err, fs.ErrNotExist):
		return nil
	case errors.Is(err, syscall.ENOTEMPTY), errors.Is(err, syscall.EBUSY):
		// Files below an unmounted target were written into the
		// directory itself (the mount was gone), or something is still
		// mounted there: berth does not delete data it did not create.
		return precondition("remove target_path %q: %v; check what is inside or mounted there", p, err)
	}
	return fmt.Errorf("remove target_path %q: %w", p, err)
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
	if err := checkPathResolves("target_path", target); err != nil {
		return nil, err
	}

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
	want := publishRecord{ReadOnly: readOnly, Mode: vcap.Mode.String(), MountFlags: vcap.MountFlags}
	if have, ok := rec.Publishes[target]; ok {
		if have.ReadOnly != want.ReadOnly || have.Mode != want.Mode || !slices.Equal(have.MountFlags, want.MountFlags) {
			return nil, alreadyExists("volume %q: published at %q with readonly=%t mode=%s mount_flags=%q; the request has readonly=%t mode=%s mount_flags=%q",
				id, target, have.ReadOnly, have.Mode, have.MountFlags, want.ReadOnly, want.Mode, want.MountFlags)
		}
		mounted, err := n.a.host.IsMountPoint(target)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
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
		}
		mounted, err := n.a.host.IsMountPoint(target)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		if mounted {
			return nil, alreadyExists("target_path %q: already a mount point that berth did not make for volume %q", target, id)
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
			errs = append(errs, removeTarget(target))
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

	source := staging
	if vcap.Block {
		d := n.a.recordedDevice(rec.Device)
		if d == nil {
			return nil, precondition("volume %q: its device %s is gone or changed since stage; unstage and stage again", id, rec.Device.Path)
		}
		source = d.Path
		created, err = createFile(target)
		if err != nil {
			return nil, err
		}
		// A read-only bind mount does not stop writes through a device
		// node: the block layer's flag must, before the pod sees it.
		dev = d
		if err := n.syncDeviceReadOnly(rec, d); err != nil {
			return nil, err
		}
	} else {
		created, err = createDir(target)
	}
	if err != nil {
		return nil, err
	}
	flags, _, err := n.mountOptions(vcap, false)
	if err != nil {
		return nil, err
	}
	if err := n.a.host.BindMount(source, target, readOnly, flags); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// createDir makes the target directory of a mount publish.
func createDir(p string) (created bool, err error) {
	err = os.Mkdir(p, 0o750)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, fs.ErrExist) {
		fi, serr := os.Lstat(p)
		if serr == nil && fi.IsDir() {
			return false, nil
		}
		return false, alreadyExists("target_path %q: exists and is not a directory", p)
	}
	return false, fmt.Errorf("create target_path %q: %w", p, err)
}

// createFile makes the target file of a block publish; the device node is
// bind-mounted onto it, so its own mode never shows.
func createFile(p string) (created bool, err error) {
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err == nil {
		return true, f.Close()
	}
	if errors.Is(err, fs.ErrExist) {
		fi, serr := os.Lstat(p)
		if serr == nil && fi.Mode().IsRegular() {
			return false, nil
		}
		return false, alreadyExists("target_path %q: exists and is not a regular file", p)
	}
	return false, fmt.Errorf("create target_path %q: %w", p, err)
}

func (n *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (_ *csi.NodeUnpublishVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, target := req.GetVolumeId(), req.GetTargetPath()
	unlock, err := n.lockVolumePath(id, "target_path", target)
	if err != nil {
		return nil, err
	}
	defer unlock()

	rec, ok := n.a.state.get(id)
	if _, published := rec.publishes()[target]; !ok || !published {
		if owner, ok := n.a.state.pathOwner(target); ok && owner != id {
			return nil, notFound("volume %q: not published at %q, which belongs to volume %q", id, target, owner)
		}
		mounted, err := n.a.host.IsMountPoint(target)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		if mounted {
			return nil, notFound("volume %q: not published at %q; the mount there was not made by berth for this volume", id, target)
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
	if err := checkPathResolves("target_path", target); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	if err := n.a.host.Unmount(target); err != nil {
		return nil, err
	}
	if err := removeTarget(target); err != nil {
		return nil, err
	}
	delete(rec.Publishes, target)
	if rec.AccessType == "block" {
		if err := n.syncRecordedReadOnly(rec); err != nil {
			return nil, err
		}
	}
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
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
	if d := n.a.recordedDevice(rec.Device); d != nil {
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
		d := n.a.recordedDevice(rec.Device)
		if d == nil {
			cond.Abnormal, cond.Message = true, fmt.Sprintf("device %s is gone or changed since stage", rec.Device.Path)
			return resp, nil
		}
		size, err := n.a.host.BlockDeviceSize(d.Path)
		if err != nil {
			return nil, err
		}
		resp.Usage = []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}
		return resp, nil
	}
	mounted, err := n.a.host.IsMountPoint(p)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if !mounted {
		cond.Abnormal, cond.Message = true, fmt.Sprintf("%s is not mounted", p)
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
	if a.recordedDevice(rec.Device) == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("device %s is gone or changed since stage", rec.Device.Path)}
	}
	if rec.AccessType != "block" {
		m, err := a.host.MountInfo(rec.StagingPath)
		if err != nil || !sameDevice(m, rec.Device) {
			return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("staging path %s no longer has the volume's filesystem mounted", rec.StagingPath)}
		}
	}
	return &csi.VolumeCondition{Abnormal: false, Message: "volume is attached and mounted"}
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
	var size int64
	if se, ok := target.(sizedExpander); ok && required > 0 {
		size, err = se.ExpandTo(ctx, required)
	} else {
		size, err = target.Expand(ctx)
	}
	if err != nil {
		return nil, err
	}
	if required > size {
		return nil, fmt.Errorf("volume %q: device %s holds %d bytes after a rescan, %d are required; grow the storage first: %w", id, rec.Device.Path, size, required, errdefs.ErrOutOfRange)
	}
	if limit > 0 && size > limit {
		return nil, fmt.Errorf("volume %q: device %s holds %d bytes, more than limit_bytes %d: %w", id, rec.Device.Path, size, limit, errdefs.ErrOutOfRange)
	}
	if rec.AccessType != "block" {
		if err := n.a.host.Resize(ctx, rec.Device.Path, rec.StagingPath, rec.FsType); err != nil {
			return nil, err
		}
	}
	rec.Device.Size = size
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
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
	if err != nil {
		return nil
	}
	if d.Major != r.Major || d.Minor != r.Minor || (r.DiskSeq != 0 && d.DiskSeq != r.DiskSeq) {
		return nil
	}
	if d.ID.Kind != r.Kind || d.ID.WWID != r.WWID || d.ID.NQN != r.NQN || d.ID.NSID != r.NSID ||
		d.ID.UUID != r.UUID || d.ID.NGUID != r.NGUID || d.ID.BackingFile != r.BackingFile {
		return nil
	}
	return d
}
