package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

// NodeUnstageVolume undoes a stage: the staging mount, the read-only
// flag berth set, the dm-crypt mapping, the attach and the record.
func (n *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (_ *csi.NodeUnstageVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	release, err := n.lockVolumePath(id, "staging_target_path", staging)
	if err != nil {
		return nil, err
	}
	locks := &heldLocks{release: release}
	defer locks.Release() // a step left blocked in the kernel takes it over
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
	unreachable, asked, err := n.stopQueueing(ctx, rec, target, locks)
	if asked {
		finished := n.resumeQueueingUnlessFinished(ctx, target, locks)
		defer func() { finished.Store(retErr == nil) }()
	}
	if err != nil {
		return nil, err
	}
	if err := n.releaseStagedDevice(ctx, rec, unreachable, locks, took); err != nil {
		return nil, err
	}
	if rec.Fence != nil && rec.Fence.Key != 0 || rec.mayHaveLostFence() {
		if err := n.blocking(ctx, "give back the reservation", locks, func() error { return n.a.unfence(ctx, rec, unreachable) }); err != nil {
			return nil, err
		}
		took.mark("unfence")
	}
	if err := n.blocking(ctx, "detach", locks, func() error { return n.detach(ctx, rec, tr, target) }); err != nil {
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
		return nil, nil, errdefs.FailedPrecondition("volume %q: staged through transport %q, which is not enabled any more; enable it to unstage", rec.VolumeID, rec.Transport)
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
		return nil, nil, errdefs.FailedPrecondition("volume %q: staged from %s target %s, but its recorded volume_context names %s target %s: the state file %s was changed since the stage; berth detaches neither: restore the record, or detach the volume's storage by hand and remove the file",
			rec.VolumeID, rec.Transport, rec.TargetKey, rec.Transport, key, n.a.state.file(rec.VolumeID))
	}
	return tr, target, nil
}

// stopQueueing makes a device none of whose paths works fail I/O, rather
// than queue it until one comes back, so that the unmount's writeback and
// the flush at unstage end. It reports whether the storage is unreachable.
//
// What the device could not write is lost once it fails I/O, so that is
// the last resort. A target whose paths are all down at the first look
// (a switch failing over, a target restarting) is given pathGrace to get
// one back first, with the device still queueing. And a filesystem that
// is mounted anywhere but the staging path (a bind of it that leaked into
// another mount) has a live user: the unstage answers ABORTED naming the
// mounts, and the device keeps queueing. asked reports whether the
// target was told to stop queueing, so that an unstage that does not
// finish gives the queueing back (resumeQueueingOnRelease).
func (n *nodeServer) stopQueueing(ctx context.Context, rec *volumeRecord, target Target, locks *heldLocks) (unreachable, asked bool, _ error) {
	if n.awaitPath(ctx, target) {
		return false, false, nil
	}
	if err := n.checkNoOtherMounts(rec); err != nil {
		return false, false, err
	}
	err := n.blocking(ctx, "stop queueing I/O of the volume's device", locks, func() error {
		u, err := target.StopQueueing(ctx)
		unreachable = u
		return err
	})
	if err != nil {
		return false, true, fmt.Errorf("volume %q: %w", rec.VolumeID, err)
	}
	if unreachable {
		logFrom(ctx, n.a.log).WarnContext(ctx, "no path to the storage works: the device fails I/O; data not yet written is lost")
	}
	return unreachable, true, nil
}

// resumeWait bounds ResumeQueueing, which runs after the request's
// context may have ended.
const resumeWait = 10 * time.Second

// resumeQueueingUnlessFinished gives the device of an unstage that does
// not finish its queueing back, as it was before StopQueueing: the
// volume stays staged, and its I/O must wait out the next outage rather
// than fail at once. The caller stores true in finished once the unstage
// succeeded. It runs when the unstage lets its locks go, so that a step
// left waiting in the kernel (an unmount's writeback) ends first:
// queueing again under it would hold it until a path comes back.
func (n *nodeServer) resumeQueueingUnlessFinished(ctx context.Context, target Target, locks *heldLocks) (finished *atomic.Bool) {
	finished = new(atomic.Bool)
	log := logFrom(ctx, n.a.log)
	locks.closeWith(func() {
		if finished.Load() {
			return
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resumeWait)
		defer cancel()
		if err := target.ResumeQueueing(rctx); err != nil {
			log.WarnContext(rctx, "the unstage did not finish, and the device's queueing could not be given back", slog.String("error", err.Error()))
		}
	})
	return finished
}

// releaseStagedDevice lets go of the volume's device at unstage: it
// unmounts the staging mount of a mount volume, clears the read-only flag
// berth set, flushes the device's buffers (unless it fails I/O anyway)
// and closes the dm-crypt mapping. Each step that may block in the kernel
// runs through blocking.
func (n *nodeServer) releaseStagedDevice(ctx context.Context, rec *volumeRecord, unreachable bool, locks *heldLocks, took *stepTimer) error {
	if rec.AccessType != "block" {
		if err := n.blocking(ctx, fmt.Sprintf("unmount %s", rec.StagingPath), locks, func() error { return n.unmountStaging(rec) }); err != nil {
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
			if err := n.blocking(ctx, "flush "+d.Path, locks, func() error { return n.a.host.FlushBuffers(d.Path) }); err != nil {
				// A node that another preempted cannot write: what
				// the flush could not write never reaches the storage,
				// and the unstage goes on.
				msg := n.a.preempted(rec)
				if msg == "" {
					return err
				}
				logFrom(ctx, n.a.log).WarnContext(ctx, "the flush failed: the volume was "+msg+"; what it held is lost", slog.String("error", err.Error()))
			}
		}
		took.mark("flush")
	}
	if rec.Crypt != nil {
		if err := n.blocking(ctx, "close the dm-crypt mapping", locks, func() error { return n.closeMapping(ctx, rec) }); err != nil {
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
			return errdefs.FailedPrecondition("volume %q: still published at %q; NodeUnpublishVolume first", rec.VolumeID, target)
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
			return errdefs.FailedPrecondition("volume %q: staging path %q shows device %d:%d of volume %q; refusing to unmount it", rec.VolumeID, rec.StagingPath, m.Major, m.Minor, owner)
		}
		return nil
	})
}

// pathGrace bounds how long an unstage waits for a path to come back
// before it makes a device without one fail I/O; at most half the
// request's remaining time is spent so, so that the unmount and detach
// that follow still fit in it.
var pathGrace = 30 * time.Second

// pathPoll is how often awaitPath looks at the paths again.
var pathPoll = 250 * time.Millisecond

// awaitPath reports whether the target has a working path, waiting up to
// pathGrace (or half of ctx's remaining time) for one when none works now.
// A target that does not count its paths (an image file), or whose count
// fails, is not waited for: StopQueueing decides for it as before.
func (n *nodeServer) awaitPath(ctx context.Context, target Target) bool {
	// counted is false where waiting cannot help: no count, or no path
	// that can come back by itself (every controller or session gone,
	// as after an earlier attempt made the device fail I/O).
	live := func() (ok, counted bool) {
		states, err := target.PathStates(ctx)
		if err != nil {
			return false, false
		}
		waiting := 0
		for st, n := range states {
			switch st {
			case "live":
				return true, true
			case "missing", "no-lun", "no-namespace":
			default:
				waiting += n
			}
		}
		return false, waiting > 0
	}
	ok, counted := live()
	if ok || !counted {
		return ok
	}
	grace := pathGrace
	if dl, has := ctx.Deadline(); has {
		grace = min(grace, time.Until(dl)/2)
	}
	log := logFrom(ctx, n.a.log)
	log.WarnContext(ctx, "no path to the storage works: waiting for one to come back before the device is made to fail I/O", slog.Duration("up_to", grace))
	t := time.NewTimer(grace)
	defer t.Stop()
	tick := time.NewTicker(pathPoll)
	defer tick.Stop()
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return false
		case <-tick.C:
			if ok, _ := live(); ok {
				log.InfoContext(ctx, "a path to the storage works again: unstaging with the device queueing as before", slog.Duration("after", time.Since(start).Round(time.Millisecond)))
				return true
			}
		}
	}
}

// checkNoOtherMounts refuses (errdefs.ErrBusy) while the volume's
// filesystem is mounted somewhere other than its staging path in this
// mount namespace: a bind of the staging path that leaked into another
// mount, whose user would lose the disk if its device failed I/O.
func (n *nodeServer) checkNoOtherMounts(rec *volumeRecord) error {
	d := rec.volumeDevice()
	if rec.AccessType == "block" || d == nil {
		return nil
	}
	points, err := n.a.host.MountPoints(d.Major, d.Minor)
	if err != nil {
		return fmt.Errorf("volume %q: list the mounts of its device: %w", rec.VolumeID, err)
	}
	var others []string
	for _, p := range points {
		if p != rec.StagingPath {
			others = append(others, p)
		}
	}
	if len(others) > 0 {
		return fmt.Errorf("volume %q: no path to its storage works, and its filesystem is still mounted at %s besides the staging path: unmount those first; berth does not make the device fail I/O under a live user: %w",
			rec.VolumeID, strings.Join(others, ", "), errdefs.ErrBusy)
	}
	return nil
}
