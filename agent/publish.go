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
		return p, errdefs.FailedPrecondition("staging_target_path: missing; berth has the STAGE_UNSTAGE_VOLUME capability and publishes staged volumes only")
	}
	if err := validatePath("staging_target_path", p.staging); err != nil {
		return p, err
	}
	if p.staging == p.target {
		return p, errdefs.InvalidArgument("target_path: equal to staging_target_path")
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
	rec, ok, err := n.a.state.lookup(id)
	switch {
	case err != nil:
		return nil, err
	case !ok || !rec.Staged:
		return nil, errdefs.FailedPrecondition("volume %q: not staged on this node; NodeStageVolume first", id)
	case rec.StagingPath != p.staging:
		return nil, errdefs.FailedPrecondition("volume %q: staged at %q, not at %q", id, rec.StagingPath, p.staging)
	case rec.AccessType != p.vcap.accessType():
		return nil, errdefs.FailedPrecondition("volume %q: staged with access type %s, publish asks for %s", id, rec.AccessType, p.vcap.accessType())
	case rec.FsType != p.vcap.FsType:
		return nil, errdefs.FailedPrecondition("volume %q: staged with fs_type %s, publish asks for %s", id, rec.FsType, p.vcap.FsType)
	}
	if owner, ok := n.a.state.pathOwner(p.target); ok && owner != id {
		return nil, errdefs.AlreadyExists("target_path %q: in use by volume %q", p.target, owner)
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
		return nil, errdefs.FailedPrecondition("volume %q: its device %s is gone or changed since stage (target lost, LUN or namespace removed or replaced) while its filesystem is mounted at %q; the filesystem is dead: NodeUnstageVolume, then stage again", p.id, rec.Device.path(), p.staging)
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
			return false, errdefs.AlreadyExists("volume %q: published at %q with readonly=%t mode=%s mount_flags=%q; the request has readonly=%t mode=%s mount_flags=%q",
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
			return false, errdefs.FailedPrecondition("volume %q: access mode SINGLE_NODE_SINGLE_WRITER allows one target and it is published at %q", id, other)
		}
		if vcap.Block && !vcap.readOnly() && pub.ReadOnly != want.ReadOnly {
			// The block layer has one read-only flag per device:
			// read-only and read-write raw block publishes of one
			// volume cannot both be what they say.
			return false, errdefs.FailedPrecondition("volume %q: published %s at %q; a raw block device is read-only for all its publishes or for none, so a %s publish beside it is refused: unpublish it first",
				id, rwName(pub.ReadOnly), other, rwName(want.ReadOnly))
		}
	}
	_, err := n.a.mountAt(tp)
	switch {
	case err == nil:
		return false, errdefs.AlreadyExists("target_path %q: already a mount point that berth did not make for volume %q", target, id)
	case !errors.Is(err, errdefs.ErrNotFound):
		return false, err
	}
	// What is there before the publish is not berth's to remove.
	h, err := tp.open()
	switch {
	case err == nil:
		h.Close()
	case errors.Is(err, errdefs.ErrNotFound):
		want.TargetMade = true
	case !errors.Is(err, errdefs.ErrInvalidArgument): // a symlink: prepareTarget refuses it
		return false, fmt.Errorf("target_path %q: %w", target, err)
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
		errs = append(errs, removeTarget(ctx, logFrom(ctx, n.a.log), tp))
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
		return nil, nil, errdefs.FailedPrecondition("volume %q: its device %s (or its dm-crypt mapping) is gone or changed since stage; unstage and stage again", id, rec.Device.path())
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
