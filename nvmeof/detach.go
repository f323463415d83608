package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
	"github.com/berth-csi/berth/internal/logctx"
)

// StopQueueing makes the namespace's head fail I/O when none of the
// subsystem's controllers is live. While a controller reconnects (with
// ctrl_loss_tmo -1, forever), the head queues I/O for it, and an unmount
// of its filesystem waits in the kernel; once the subsystem has no
// controller left, the head fails its queued and new I/O. So the volume's
// controllers are deleted now, as Detach would delete them after the
// unmount. Controllers that other volumes need stay (see othersNeed): the
// head then queues on until they reconnect or the other volumes let them
// go. A head with a live controller is left as it is.
func (tg *Target) StopQueueing(ctx context.Context) (bool, error) {
	t := tg.t
	held, err := t.locks.Hold(ctx, tg.vol.NQN)
	if err != nil {
		return false, fmt.Errorf("%s: %w", tg.Key(), err)
	}
	defer held.Release()
	h, ok, err := tg.head()
	if err != nil || !ok {
		return false, err
	}
	ctrls, err := t.sys.readControllers(tg.vol.NQN)
	if err != nil {
		return false, fmt.Errorf("%s: %w", tg.Key(), err)
	}
	var states []string
	for _, c := range ctrls {
		if c.SubsysNQN != tg.vol.NQN || c.Deleting() {
			continue
		}
		if c.State == StateLive {
			return false, nil
		}
		states = append(states, c.Name+" "+c.State)
	}
	t.mu.Lock()
	t.stopping[tg.Key()] = true
	t.mu.Unlock()
	keep, err := tg.othersNeed(ctx)
	if err != nil {
		return false, fmt.Errorf("%s: %w", tg.Key(), err)
	}
	logctx.From(ctx, t.log).Warn("nvmeof: no controller is live; deleting the volume's controllers so that its namespace fails I/O instead of queueing it",
		"target", tg.Key(), "namespace", h.Name, "controllers", strings.Join(states, ", "))
	if err := tg.deleteControllers(ctx, keep); err != nil {
		return false, fmt.Errorf("%s: %w", tg.Key(), err)
	}
	return true, nil
}

// ResumeQueueing, for an unstage that did not finish after
// StopQueueing, takes the volume back among those whose controllers
// others keep (see othersNeed): it is staged still. The controllers
// StopQueueing deleted stay deleted: connecting needs the stage's
// secrets, and the next stage connects them.
func (tg *Target) ResumeQueueing(context.Context) error {
	t := tg.t
	t.mu.Lock()
	delete(t.stopping, tg.Key())
	t.mu.Unlock()
	return nil
}

// Detach flushes the namespace and deletes the volume's controllers
// that no other volume needs (see Options.Staged). It refuses while the
// namespace itself is still mounted or held open. Controllers that are
// already gone are success, so Detach can be repeated.
func (tg *Target) Detach(ctx context.Context, _ *devices.Recorded) error {
	t := tg.t
	held, err := t.locks.Hold(ctx, tg.vol.NQN)
	if err != nil {
		return fmt.Errorf("detach %s: %w", tg.Key(), err)
	}
	defer held.Release()

	h, ok, err := tg.head()
	if err != nil {
		return fmt.Errorf("detach %s: %w", tg.Key(), err)
	}
	if ok {
		dev := filepath.Join(t.opts.DevRoot, h.Name)
		if openedExclusively(dev) {
			return fmt.Errorf("detach %s: %s is still mounted or held open: %w", tg.Key(), dev, errdefs.ErrBusy)
		}
		if err := t.flush(ctx, dev); err != nil {
			// A flush refused with a reservation conflict: under Write
			// Exclusive - Registrants Only, NVMe Flush is a write
			// command, refused to a host that is not registered (a
			// stage refused before it registered, a node another
			// preempted). Such a host writes nothing to the namespace,
			// so its detach goes on.
			if !errors.Is(err, devices.ErrReservationConflict) {
				return fmt.Errorf("detach %s: %w", tg.Key(), err)
			}
			logctx.From(ctx, t.log).Warn("nvmeof: the flush was refused with a reservation conflict: another host's reservation forbids this host's writes, so nothing this host holds can reach the namespace; disconnecting",
				"target", tg.Key(), "namespace", h.Name, "error", err.Error())
		}
		failpoint.Hit("nvmeof.flushed")
	}
	t.mu.Lock()
	t.released[tg.Key()] = true
	t.mu.Unlock()

	keep, err := tg.othersNeed(ctx)
	if err != nil {
		return fmt.Errorf("detach %s: %w", tg.Key(), err)
	}
	if err := tg.deleteControllers(ctx, keep); err != nil {
		return fmt.Errorf("detach %s: %w", tg.Key(), err)
	}
	if host := t.knownHostNQN(); tg.vol.TLS && host != "" {
		tg.dropKeys(ctx, host)
	}
	return nil
}

// othersNeed returns a test for whether a controller must stay for
// other users of the subsystem: volumes listed by Options.Staged (other
// than this one and those this process has released) whose paths it
// serves, or, when another namespace of the subsystem is mounted or held
// open, every controller of the subsystem. A volume whose own unstage found
// every path of the subsystem dead (StopQueueing) needs none: it is going
// too, and keeping the controllers for it would have each of two such
// unstages wait in the kernel for the other until ctrl_loss_tmo.
func (tg *Target) othersNeed(ctx context.Context) (func(ctrl string) bool, error) {
	t := tg.t
	heads, err := t.sys.readHeads(tg.vol.NQN)
	if err != nil {
		return nil, err
	}
	var others, going []*Volume
	if t.opts.Staged != nil {
		vcs, err := t.opts.Staged(ctx)
		if err != nil {
			return nil, fmt.Errorf("list staged volumes: %w", err)
		}
		t.mu.Lock()
		for _, vc := range vcs {
			v, err := ParseVolumeContext(vc)
			if err != nil || v.NQN != tg.vol.NQN || v.Key() == tg.Key() || t.released[v.Key()] {
				continue
			}
			if t.stopping[v.Key()] {
				going = append(going, v)
				continue
			}
			others = append(others, v)
		}
		t.mu.Unlock()
	}
	for _, h := range heads {
		if h.matches(tg.vol) || slices.ContainsFunc(going, h.matches) {
			continue
		}
		if openedExclusively(filepath.Join(t.opts.DevRoot, h.Name)) {
			logctx.From(ctx, t.log).Debug("nvmeof: subsystem in use", "target", tg.Key(), "namespace", h.Name)
			return func(string) bool { return true }, nil
		}
	}
	if len(others) == 0 {
		return func(string) bool { return false }, nil
	}
	ctrls, err := t.sys.readControllers(tg.vol.NQN)
	if err != nil {
		return nil, err
	}
	need := make(map[string]bool)
	for _, v := range others {
		for _, p := range v.Paths {
			rp, err := (&Target{t: t, vol: v}).resolve(ctx, p)
			if err != nil {
				// Unknown address: keep every controller of the subsystem.
				return func(string) bool { return true }, nil
			}
			for i := range ctrls {
				if ctrls[i].matches(tg.vol.NQN, "", rp) {
					need[ctrls[i].Name] = true
				}
			}
		}
	}
	return func(c string) bool { return need[c] }, nil
}

// deleteControllers deletes the controllers of the volume's paths, but
// those keep names.
func (tg *Target) deleteControllers(ctx context.Context, keep func(ctrl string) bool) error {
	t := tg.t
	ctrls, err := t.sys.readControllers(tg.vol.NQN)
	if err != nil {
		return err
	}
	var host string
	if id, err := t.HostIdentity(); err == nil {
		host = id.NQN
	}
	var errs []error
	for _, p := range tg.vol.Paths {
		rp, rerr := tg.resolve(ctx, p)
		for i := range ctrls {
			c := &ctrls[i]
			var match bool
			if rerr == nil {
				match = c.matches(tg.vol.NQN, host, rp)
			} else {
				// The name does not resolve now: take every controller
				// of the subsystem at that port.
				match = !c.Deleting() && c.SubsysNQN == tg.vol.NQN && c.Transport == p.TrType &&
					samePort(c.Address.TrSvcID, p.TrSvcID) && (host == "" || c.HostNQN == host)
			}
			if !match {
				continue
			}
			if keep(c.Name) {
				logctx.From(ctx, t.log).Debug("nvmeof: keeping controller for other volumes", "target", tg.Key(), "controller", c.Name)
				continue
			}
			is := func(cur *Controller) bool { return cur.same(c) }
			if err := t.sys.deleteController(tg.vol.NQN, c.Name, is); err != nil {
				errs = append(errs, err)
				continue
			}
			logctx.From(ctx, t.log).Info("nvmeof: disconnected", "target", tg.Key(), "path", p.String(), "controller", c.Name)
			failpoint.Hit("nvmeof.disconnected")
		}
	}
	return errors.Join(errs...)
}

// flushDev is devices.FlushPath; tests replace it with a device that
// does not answer.
var flushDev = devices.FlushPath

// flush runs devices.FlushPath on dev in a goroutine of its own and waits for
// it until ctx ends: a namespace whose I/O is queued (its controllers
// reconnecting, with ctrl_loss_tmo -1 for ever) does not complete an
// fsync, and nothing can cancel one. The caller then gets an error
// wrapping errdefs.ErrUnavailable and ctx's error, and lets the
// subsystem's lock go; the flush goes on and holds dev's key in
// t.flushing until it returns. The next flush of dev waits for that key
// within its own ctx instead of starting another fsync behind it.
func (t *Transport) flush(ctx context.Context, dev string) error {
	unlock, err := t.flushing.Lock(ctx, dev)
	if err != nil {
		return fmt.Errorf("flush %s: an earlier flush of the device has not returned by the request's deadline "+
			"(its I/O is queued: check the paths to the subsystem): %w", dev, errors.Join(errdefs.ErrUnavailable, err))
	}
	done := make(chan error, 1)
	go func() {
		defer unlock()
		done <- flushDev(dev)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("flush %s: not done by the request's deadline (its I/O is queued: check the paths to the subsystem); "+
			"it goes on, and the next detach waits for it: %w", dev, errors.Join(errdefs.ErrUnavailable, ctx.Err()))
	}
}
