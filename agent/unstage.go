package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

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

	rec, ok, err := n.a.state.lookup(id)
	if err != nil {
		return nil, err
	}
	if !ok {
		// Not staged (or already unstaged): the CSI answer is OK.
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if rec.StagingPath != staging {
		log.WarnContext(ctx, "volume is staged at another path; nothing to do here", slog.String("recorded_staging_path", rec.StagingPath))
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	tl, err := n.a.lockTrimForUnstage(id)
	if err != nil {
		return nil, err
	}
	defer tl.Close()
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
	// A format that did not finish (see volumeRecord.Formatting) was
	// never given to a pod: the mark it may have written names a
	// filesystem that a retry may have made again since.
	if rec.Formatting != nil {
		if err := n.a.marks.remove(id); err != nil {
			return nil, err
		}
	}
	if err := n.a.state.remove(id); err != nil {
		return nil, err
	}
	if err := tl.remove(); err != nil {
		log.WarnContext(ctx, "remove the volume's trim lock file", slog.String("error", err.Error()))
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
		if !rec.Publishes[target].TargetMade {
			break // the CO's target: left
		}
		if err := removeTarget(ctx, logFrom(ctx, n.a.log), tp); err != nil {
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
