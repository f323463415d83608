package agent

import (
	"context"
	"errors"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

// NodeUnpublishVolume unmounts a volume's bind at the target path,
// removes the target and forgets the publish.
func (n *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (_ *csi.NodeUnpublishVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, target := req.GetVolumeId(), req.GetTargetPath()
	release, err := n.lockVolumePath(id, "target_path", target)
	if err != nil {
		return nil, err
	}
	locks := &heldLocks{release: release}
	defer locks.Release() // a step left blocked in the kernel takes it over
	took := newStepTimer()

	rec, ok, err := n.a.state.lookup(id)
	if err != nil {
		return nil, err
	}
	_, published := rec.publishes()[target]
	tp, err := holdTarget(target, locks)
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
		if err := n.unmountTarget(ctx, id, target, rec.Publishes[target].TargetMade, tp, locks, took); err != nil {
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
// closed with the locks: by a step left blocked in the kernel when it
// ends (see blocking).
func holdTarget(target string, locks *heldLocks) (*heldPath, error) {
	tp, err := holdPath("target_path", target)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, nil
	case err != nil:
		return nil, err
	}
	locks.closeWith(tp.close)
	return tp, nil
}

// unpublishedAlready answers an unpublish of a target the volume has no
// publish record for: OK, unless the target is another volume's or holds
// a mount berth did not make for this volume. A retry after the publish
// record went but the read-only flag could not follow it finishes that.
// rec is nil when the volume has no record.
func (n *nodeServer) unpublishedAlready(rec *volumeRecord, id, target string, tp *heldPath) error {
	if owner, ok := n.a.state.pathOwner(target); ok && owner != id {
		return errdefs.NotFound("volume %q: not published at %q, which belongs to volume %q", id, target, owner)
	}
	if tp != nil {
		_, err := n.a.mountAt(tp)
		switch {
		case err == nil:
			return errdefs.NotFound("volume %q: not published at %q; the mount there was not made by berth for this volume", id, target)
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
// removes the target if berth made it (made). What is mounted there is
// berth's bind, even a wrong one (made while the staging mount was
// lost), and is unmounted; never a mount of another volume berth knows.
func (n *nodeServer) unmountTarget(ctx context.Context, id, target string, made bool, tp *heldPath, locks *heldLocks, took *stepTimer) error {
	err := n.blocking(ctx, "unmount "+target, locks, func() error {
		return n.a.host.Unmount(tp.dir, tp.name, func(m mountEntry) error {
			if owner, ok := n.a.mountOwner(m, id); ok {
				return errdefs.FailedPrecondition("volume %q: target_path %q shows the device of volume %q; refusing to unmount it", id, target, owner)
			}
			return nil
		})
	})
	if err != nil {
		return err
	}
	took.mark("unmount")
	if !made {
		return nil
	}
	if err := removeTarget(ctx, logFrom(ctx, n.a.log), tp); err != nil {
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
