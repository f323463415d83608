package iscsi

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
	"github.com/berth-csi/berth/internal/logctx"
)

// StopQueueing makes the LUN's device fail I/O when none of its paths
// works, so that an unmount or a flush ends instead of waiting in the
// kernel for a path that may never come back. A multipath map (with
// queue_if_no_path, or multipathd's no_path_retry queue) is told to fail
// I/O. A LUN without a map queues on its session's disk until the
// session's replacement timeout: when no session of the LUN is logged in,
// each session that carries this LUN alone is logged out, which fails the
// queued I/O at once, as Detach would after the unmount; a session other
// LUNs share is left to recover or time out. A device with a working path
// is left as it is.
func (tg *Target) StopQueueing(ctx context.Context) (bool, error) {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return false, err
	}
	dm := t.mapOf(pds)
	if dm == nil {
		return t.stopDiskQueueing(ctx, v, pds)
	}
	ps, err := devices.MultipathPaths(dm)
	if err != nil {
		return false, err
	}
	if slices.ContainsFunc(ps, devices.PathState.Working) {
		return false, nil
	}
	queued, err := devices.QueuesIfNoPath(dm)
	if err != nil {
		return false, fmt.Errorf("iSCSI %s LUN %d: %w", v.IQN, v.LUN, err)
	}
	if err := t.failQueueing(ctx, dm); err != nil {
		return false, fmt.Errorf("iSCSI %s LUN %d: no path works: %w", v.IQN, v.LUN, err)
	}
	if queued {
		tg.requeue = dm
	}
	logctx.From(ctx, t.log).Warn("iSCSI: no path works; the multipath map fails I/O instead of queueing it", "target", v.IQN, "lun", v.LUN, "map", mapName(dm))
	return true, nil
}

// ResumeQueueing has the multipath map that StopQueueing made fail I/O
// queue it again, at once through device-mapper and through multipathd
// (which otherwise keeps queueing off when it next loads the map). A
// session StopQueueing logged out stays so: logging in needs the stage's
// secrets, and the next stage does it.
func (tg *Target) ResumeQueueing(ctx context.Context) error {
	dm := tg.requeue
	if dm == nil {
		return nil
	}
	t, v := tg.t, tg.v
	if err := devices.SetQueueIfNoPath(dm, true); err != nil {
		return fmt.Errorf("iSCSI %s LUN %d: %w", v.IQN, v.LUN, err)
	}
	// multipathd, told to disable queueing of the map, turns it off
	// again at its next check until it is told to restore it: unlike
	// the disable, this request is waited for as long as ctx allows
	// (multipathd answers slowly while its checkers wait on dead paths).
	if _, err := t.run.run(ctx, t.opts.Multipathd, "restorequeueing", "map", mapName(dm)); err != nil {
		logctx.From(ctx, t.log).Warn("iSCSI: multipathd did not take the map's queueing back; it may turn queueing off again", "map", mapName(dm), "error", err)
	}
	tg.requeue = nil
	logctx.From(ctx, t.log).Warn("iSCSI: the unstage did not finish; the multipath map queues I/O again while no path works", "target", v.IQN, "lun", v.LUN, "map", mapName(dm))
	return nil
}

// stopDiskQueueing is StopQueueing for a LUN without a multipath map.
func (t *Transport) stopDiskQueueing(ctx context.Context, v *Volume, pds []*pathDevice) (bool, error) {
	if len(pds) == 0 || slices.ContainsFunc(pds, func(pd *pathDevice) bool { return pd.sess.State == "LOGGED_IN" }) {
		return false, nil
	}
	for _, pd := range pds {
		if err := t.logoutFailed(ctx, v, pd.path); err != nil {
			return true, fmt.Errorf("iSCSI %s LUN %d: no session is logged in: %w", v.IQN, v.LUN, err)
		}
	}
	return true, nil
}

// logoutFailed logs out of the session through p when it is not logged
// in and carries no LUN but v's, so that the disk's queued I/O fails now
// rather than at the replacement timeout.
func (t *Transport) logoutFailed(ctx context.Context, v *Volume, p path) error {
	held, err := t.lockPath(ctx, v.IQN, p, v.Iface)
	if err != nil {
		return err
	}
	defer held.Release()
	sess, err := t.findSession(v.IQN, p, v.Iface)
	if err != nil || sess == nil || sess.State == "LOGGED_IN" {
		return err
	}
	luns, err := t.sys.LUNs(sess.ID)
	if err != nil {
		return err
	}
	if len(luns) > 1 || (len(luns) == 1 && luns[0].LUN != v.LUN) {
		logctx.From(ctx, t.log).Warn("iSCSI: no session is logged in; other LUNs share the session, so the disk queues I/O until the session's replacement timeout", "target", v.IQN, "lun", v.LUN, "session", sess.ID, "state", sess.State)
		return nil
	}
	if err := t.logout(ctx, held, v, p, sess); err != nil {
		return err
	}
	logctx.From(ctx, t.log).Warn("iSCSI: no session is logged in; logged out of the LUN's session so that its disk fails I/O instead of queueing it", "target", v.IQN, "lun", v.LUN, "session", sess.ID, "state", sess.State)
	return nil
}

// Detach removes the LUN's device (and its multipath map) and logs out of
// each session that no longer has any LUN. Sessions that other volumes
// still use stay. It needs no secrets and is idempotent.
func (tg *Target) Detach(ctx context.Context, _ *devices.Recorded) error {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return err
	}
	// Nothing is removed while something still uses the LUN: a mount of
	// its filesystem outside the staging path (a bind that leaked into
	// another mount namespace), a process that opened it exclusively.
	if err := inUse(t.mapOf(pds), pds); err != nil {
		return fmt.Errorf("detach iSCSI %s LUN %d: %w", v.IQN, v.LUN, err)
	}
	var errs []error
	// The map first: removing a path under a map would make it queue or
	// fail I/O.
	if dm := t.mapOf(pds); dm != nil {
		if err := t.removeMap(ctx, dm); err != nil {
			return fmt.Errorf("detach iSCSI %s LUN %d: %w", v.IQN, v.LUN, err)
		}
	}
	seen := map[string]bool{}
	for _, pd := range pds {
		seen[pd.path.key(v.IQN, v.Iface)] = true
		if err := t.detachPath(ctx, v, pd.path); err != nil {
			errs = append(errs, err)
		}
	}
	// Portals without a session: drop leftover records (a crash between
	// record creation and login).
	for _, p := range paths {
		if seen[p.key(v.IQN, v.Iface)] {
			continue
		}
		if err := t.detachPath(ctx, v, p); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("detach iSCSI %s LUN %d: %w", v.IQN, v.LUN, errors.Join(errs...))
	}
	return nil
}

// inUse checks the LUN's map, or without one each of its disks, with
// devices.InUse.
func inUse(dm *devices.Device, pds []*pathDevice) error {
	if dm != nil {
		return devices.InUse(dm)
	}
	for _, pd := range pds {
		if pd.dev == nil {
			continue
		}
		if err := devices.InUse(pd.dev); err != nil {
			return err
		}
	}
	return nil
}

// detachPath removes the LUN's disk from the session through p and logs
// out when the session has no LUN left. No session: the record is deleted.
// Once the session and the record are gone, the path's lock goes with
// its file (pathLock.removeFile).
func (t *Transport) detachPath(ctx context.Context, v *Volume, p path) error {
	held, err := t.lockPath(ctx, v.IQN, p, v.Iface)
	if err != nil {
		return err
	}
	defer held.Release()
	sess, err := t.findSession(v.IQN, p, v.Iface)
	if err != nil {
		return err
	}
	if sess == nil {
		if err := t.deleteRecord(ctx, v, p); err != nil {
			return err
		}
		return held.removeFile()
	}
	if sess.State != "LOGGED_IN" {
		// The target is unreachable: the disk's queue is blocked until
		// the replacement timeout, and deleting it would wait that long
		// to flush its cache. When the LUN is all the session has, the
		// logout takes the disk with it, at once.
		luns, err := t.sys.LUNs(sess.ID)
		if err != nil {
			return err
		}
		if len(luns) == 0 || (len(luns) == 1 && luns[0].LUN == v.LUN) {
			return t.logout(ctx, held, v, p, sess)
		}
	}
	if h, ok, err := t.sessionLUN(sess.ID, v.LUN); err != nil {
		return err
	} else if ok {
		if err := t.removeDisk(ctx, sess, h); err != nil {
			return err
		}
		failpoint.Hit("iscsi.disk_removed")
	}
	return t.logoutIfUnused(ctx, held, v, p, sess)
}

// removeDisk flushes and deletes the SCSI disk h of sess. When the session
// is not logged in (target gone), the disk is set offline first so that
// its removal does not wait for the session's replacement timeout.
//
// h was read from the session's LUNs a moment ago; a SCSI host's number
// goes to the next session as soon as its own session logs out (a
// crashed agent's logout may still finish meanwhile), and h then names
// another session's LUN. So the device is opened once and checked to
// still be a LUN of sess, and it is set offline and deleted through that
// descriptor; its disk, if it has one, is removed as the device that
// descriptor shows.
//
// The whole removal runs in the background (see inflight): setting a
// device offline, reading it and deleting it may each wait in the kernel
// while its session recovers, and no RPC may outlive its deadline.
func (t *Transport) removeDisk(ctx context.Context, sess *Session, h HCTL) error {
	key := fmt.Sprintf("session%d/%s", sess.ID, h)
	return t.removals.remove(ctx, key, fmt.Sprintf("SCSI device %s of session %d", h, sess.ID), func(ctx context.Context) error {
		return t.removeDiskNow(ctx, sess, h)
	})
}

func (t *Transport) removeDiskNow(ctx context.Context, sess *Session, h HCTL) error {
	lun, err := t.sys.openLUN(sess.ID, h)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil // gone, or another session's now
	}
	if err != nil {
		return err
	}
	defer lun.Close()
	if lun.state() == "running" {
		if cur, err := t.sys.Session(sess.ID); err == nil && cur.State != "LOGGED_IN" {
			if err := lun.offline(); err != nil {
				logctx.From(ctx, t.log).Debug("set SCSI device offline before removal", "hctl", h.String(), "error", err)
			}
		}
	}
	name, err := lun.blockDevice()
	if err == nil {
		dev, err := t.devs.Lookup(name)
		if err == nil && dev.ID.HCTL != h.String() {
			// The disk name went to another device after the one read
			// through the descriptor: nothing of h's is left to remove.
			return nil
		}
		if err == nil {
			if err := devices.RemoveSCSIDevice(ctx, t.opts.Listener, dev); err != nil {
				return fmt.Errorf("remove SCSI disk %s (%s): %w", dev.Path, h, err)
			}
			return nil
		}
		if !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
	}
	// A SCSI device without a disk (never opened, or its disk already
	// gone): delete it directly.
	if err := lun.delete(); err != nil {
		return fmt.Errorf("remove SCSI device %s: %w", h, err)
	}
	return nil
}

// inflight runs each disk removal once, in the background: the kernel's
// delete of a disk whose target is unreachable blocks until the session's
// replacement timeout, and no RPC may outlive its deadline. A retry of the
// same removal waits for the one in flight.
type inflight struct {
	mu sync.Mutex
	m  map[string]chan struct{}
	e  map[string]error
}

func (in *inflight) remove(ctx context.Context, key, what string, fn func(context.Context) error) error {
	in.mu.Lock()
	if in.m == nil {
		in.m, in.e = map[string]chan struct{}{}, map[string]error{}
	}
	done, running := in.m[key]
	if !running {
		done = make(chan struct{})
		in.m[key] = done
		// The removal's own bound is generous; the caller's deadline
		// only bounds how long the caller waits.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), removeBound)
		go func() {
			defer cancel()
			err := fn(rctx)
			in.mu.Lock()
			in.e[key] = err
			delete(in.m, key)
			close(done)
			in.mu.Unlock()
		}()
	}
	in.mu.Unlock()
	select {
	case <-done:
		in.mu.Lock()
		err := in.e[key]
		delete(in.e, key)
		in.mu.Unlock()
		return err
	case <-ctx.Done():
		return fmt.Errorf("remove %s: the kernel is still deleting it (a disk of an unreachable target waits for the session's replacement timeout); retry later: %w", what,
			errors.Join(errdefs.ErrUnavailable, ctx.Err()))
	}
}

// removeBound caps a background disk removal.
const removeBound = 15 * time.Minute

// logoutIfUnused logs out of sess when it has no SCSI device left, and
// deletes the node record with it (and gives held up, see logout).
func (t *Transport) logoutIfUnused(ctx context.Context, held *pathLock, v *Volume, p path, sess *Session) error {
	luns, err := t.sys.LUNs(sess.ID)
	if err != nil {
		return err
	}
	if len(luns) > 0 {
		logctx.From(ctx, t.log).Debug("iSCSI session kept: other LUNs use it", "session", sess.ID, "target", v.IQN, "luns", len(luns))
		return nil
	}
	if t.testHookLoggingOut != nil {
		t.testHookLoggingOut()
	}
	return t.logout(ctx, held, v, p, sess)
}

// logout logs out of sess and deletes its node record; then the path's
// lock, held, goes with its file, and the caller holds it no more.
func (t *Transport) logout(ctx context.Context, held *pathLock, v *Volume, p path, sess *Session) error {
	if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsSessionLogout(sess.ID)...); err != nil {
		switch command.ExitCode(err) {
		case ISCSI_ERR_SESS_NOT_FOUND, ISCSI_ERR_NO_OBJS_FOUND:
		default:
			return t.iscsiadmError(fmt.Sprintf("log out of session %d (%s at %s)", sess.ID, v.IQN, p), err)
		}
	}
	failpoint.Hit("iscsi.logged_out")
	if err := t.deleteRecord(ctx, v, p); err != nil {
		return err
	}
	return held.removeFile()
}

func (t *Transport) deleteRecord(ctx context.Context, v *Volume, p path) error {
	// Where the record directory is visible and holds no record of the
	// portal there is nothing to delete, and iscsiadm is not asked: a
	// stage that failed before its login (iscsi_tcp not loaded, say)
	// must unstage on a node where iscsiadm is missing too.
	if _, err := t.db.nodeRecordFiles(v.IQN, p.IP, p.Port, v.Iface); errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsNodeDelete(v.IQN, p.IP, p.Port, v.Iface)...); err != nil {
		if c := command.ExitCode(err); c == ISCSI_ERR_NO_OBJS_FOUND || c == ISCSI_ERR_SESS_NOT_FOUND {
			return nil
		}
		return t.iscsiadmError(fmt.Sprintf("delete the node record of %s at %s", v.IQN, p), err)
	}
	return nil
}
