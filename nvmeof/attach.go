package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
	"github.com/berth-csi/berth/internal/logctx"
)

// Preflight checks that the kernel's fabrics interface is there (the
// nvme-fabrics module is loaded), changing nothing.
func (tg *Target) Preflight(context.Context) error {
	if tg.t.opts.Listener == nil {
		return fmt.Errorf("attach %s: the transport has no device listener: %w", tg.Key(), errdefs.ErrFailedPrecondition)
	}
	if _, err := os.Stat(tg.t.opts.FabricsDevice); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("attach %s: %s does not exist: the nvme-fabrics module is not loaded (modprobe nvme-tcp, and add it to /etc/modules-load.d): %w", tg.Key(), tg.t.opts.FabricsDevice, errdefs.ErrUnavailable)
	}
	return nil
}

// Attach connects every path of the volume that has no live (or
// reconnecting) controller yet, reusing existing ones, then waits for
// the namespace device and returns it. It succeeds when at least one
// path is connected and the namespace appears; failed paths show in
// Health and are retried by the next Attach.
func (tg *Target) Attach(ctx context.Context) (_ *devices.Device, retErr error) {
	t := tg.t
	if t.opts.Listener == nil {
		return nil, fmt.Errorf("attach %s: the transport has no device listener: %w", tg.Key(), errdefs.ErrFailedPrecondition)
	}
	host, err := t.HostIdentity()
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	// Connects and deletes of one subsystem are serialized; the wait
	// for the namespace below is not.
	held, err := t.locks.Hold(ctx, tg.vol.NQN)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	defer held.Release()
	t.mu.Lock()
	delete(t.released, tg.Key())
	delete(t.stopping, tg.Key())
	t.mu.Unlock()

	// Subscribe before connecting so that the namespace's uevent cannot
	// be missed.
	w := t.opts.Listener.Subscribe(tg.matcher())
	defer w.Close()

	ctrls, err := t.sys.readControllers(tg.vol.NQN)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	if err := checkHostConflict(ctrls, host); err != nil {
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	if err := tg.checkKernelAuth(ctrls); err != nil {
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	var tc *tlsConn
	if tg.vol.TLS {
		if tc, err = tg.prepareTLS(ctx, host, ctrls); err != nil {
			return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
		}
		defer func() {
			if retErr != nil && (tg.tlsKey != nil || tg.vol.TLSConcat) {
				// Runs after the undo of the connects below (defers
				// run last in, first out): berth's key goes with the
				// last controller of the subsystem, also one an
				// earlier stage left.
				tg.dropKeys(context.WithoutCancel(ctx), host.NQN)
			}
		}()
	}

	results := make([]pathResult, len(tg.vol.Paths))
	skip := tg.skipSilent(time.Now())
	var wg sync.WaitGroup
	for i, p := range tg.vol.Paths {
		if since, ok := skip[p.String()]; ok {
			results[i] = pathResult{path: p, err: fmt.Errorf("not tried: a connect through it found it silent %s ago; it is tried again after %s: %w",
				since.Round(time.Second), silentWindow, errdefs.ErrUnavailable)}
			continue
		}
		wg.Go(func() {
			results[i] = tg.attachPath(ctx, host, ctrls, p, tc)
			tg.noteSilent(p, results[i].err)
		})
	}
	wg.Wait()

	var created []pathResult
	var errs []error
	connected := 0
	for _, r := range results {
		switch {
		case r.err != nil:
			errs = append(errs, fmt.Errorf("path %s: %w", r.path, r.err))
		case r.created:
			created = append(created, r)
			connected++
		default:
			connected++
		}
	}
	defer func() {
		if retErr == nil || len(created) == 0 {
			return
		}
		// Undo the controllers this call created, unless another
		// volume of the subsystem uses them.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := held.Retake(cctx); err != nil {
			logctx.From(ctx, t.log).Warn("nvmeof: undo connect", "target", tg.Key(), "error", err)
			return
		}
		keep, err := tg.othersNeed(cctx)
		if err != nil {
			logctx.From(ctx, t.log).Warn("nvmeof: undo connect", "target", tg.Key(), "error", err)
			return
		}
		for _, r := range created {
			if keep(r.ctrl) {
				continue
			}
			is := func(c *Controller) bool { return c.matches(tg.vol.NQN, host.NQN, r.rpath) }
			if err := t.sys.deleteController(tg.vol.NQN, r.ctrl, is); err != nil {
				logctx.From(ctx, t.log).Warn("nvmeof: undo connect", "controller", r.ctrl, "error", err)
			}
		}
	}()
	if connected == 0 {
		return nil, fmt.Errorf("attach %s: no path connected: %w", tg.Key(), errors.Join(errs...))
	}
	for _, e := range errs {
		logctx.From(ctx, t.log).Warn("nvmeof: path not connected", "target", tg.Key(), "error", e)
	}

	held.Release()
	wctx, cancel := context.WithTimeout(ctx, t.opts.NamespaceTimeout)
	defer cancel()
	dev, err := w.Wait(wctx)
	if err != nil {
		if ctx.Err() == nil && wctx.Err() != nil {
			return nil, fmt.Errorf("attach %s: connected (%d of %d paths) but no namespace appeared within %s: check nsid/uuid/nguid and that the subsystem exports the namespace to this host: %w",
				tg.Key(), connected, len(tg.vol.Paths), t.opts.NamespaceTimeout, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	if err := tg.verify(dev); err != nil {
		return nil, fmt.Errorf("attach %s: %w", tg.Key(), err)
	}
	return dev, nil
}

// silentWindow is how long a path that did not answer a connect is left
// out of the stages of its subsystem's volumes, while another path may
// serve them. Connects of one subsystem run one after the other (its
// lock), so without it every stage of a volume of that subsystem waits for
// the silent path in turn: four at once over a path that accepts and never
// answers took 11, 21, 31 and 42 s.
const silentWindow = 30 * time.Second

// skipSilent returns the volume's paths found silent within silentWindow,
// with how long ago, unless every path was: then all are tried.
func (tg *Target) skipSilent(now time.Time) map[string]time.Duration {
	t := tg.t
	t.mu.Lock()
	defer t.mu.Unlock()
	skip := make(map[string]time.Duration)
	for _, p := range tg.vol.Paths {
		at, ok := t.silent[tg.vol.NQN+" "+p.String()]
		if ok && now.Sub(at) < silentWindow {
			skip[p.String()] = now.Sub(at)
		}
	}
	if len(skip) == len(tg.vol.Paths) {
		return nil
	}
	return skip
}

// noteSilent records whether a connect through p found it silent.
func (tg *Target) noteSilent(p Path, err error) {
	t := tg.t
	t.mu.Lock()
	defer t.mu.Unlock()
	key := tg.vol.NQN + " " + p.String()
	switch {
	case errors.Is(err, errSilent):
		t.silent[key] = time.Now()
	case err == nil:
		delete(t.silent, key)
	}
}

// pathResult is the outcome of attaching one path.
type pathResult struct {
	path    Path
	rpath   Path   // path with its address resolved
	ctrl    string // controller name
	created bool
	err     error
}

// verify checks that dev is the namespace the volume names.
func (tg *Target) verify(dev *devices.Device) error {
	id := dev.ID
	switch {
	case id.Kind != devices.KindNVMe:
		return fmt.Errorf("device %s is not an NVMe namespace: %w", dev, errdefs.ErrFailedPrecondition)
	case id.NQN != tg.vol.NQN:
		return fmt.Errorf("device %s belongs to subsystem %s, not %s: %w", dev, id.NQN, tg.vol.NQN, errdefs.ErrFailedPrecondition)
	case tg.vol.NSID != 0 && id.NSID != tg.vol.NSID:
		return fmt.Errorf("device %s is namespace %d, not %d: %w", dev, id.NSID, tg.vol.NSID, errdefs.ErrFailedPrecondition)
	case tg.vol.UUID != "" && normalizeZeroID(id.UUID) != tg.vol.UUID:
		return fmt.Errorf("device %s has UUID %q, not %s: %w", dev, id.UUID, tg.vol.UUID, errdefs.ErrFailedPrecondition)
	case tg.vol.NGUID != "" && normalizeZeroID(id.NGUID) != tg.vol.NGUID:
		return fmt.Errorf("device %s has NGUID %q, not %s: %w", dev, id.NGUID, tg.vol.NGUID, errdefs.ErrFailedPrecondition)
	}
	return dev.Verify()
}

// attachPath reuses the controller for p or connects a new one.
func (tg *Target) attachPath(ctx context.Context, host HostIdentity, ctrls []Controller, p Path, tc *tlsConn) pathResult {
	t := tg.t
	r := pathResult{path: p}
	rp, err := tg.resolve(ctx, p)
	if err != nil {
		r.err = err
		return r
	}
	r.rpath = rp
	find := func(cs []Controller) string {
		for i := range cs {
			if cs[i].matches(tg.vol.NQN, host.NQN, rp) {
				return cs[i].Name
			}
		}
		return ""
	}
	if c := find(ctrls); c != "" {
		if err := tg.checkReuse(c); err != nil {
			r.err = err
			return r
		}
		if err := tg.checkTLSReuse(c, tc); err != nil {
			r.err = err
			return r
		}
		logctx.From(ctx, t.log).Debug("nvmeof: reusing controller", "target", tg.Key(), "path", p.String(), "controller", c)
		r.ctrl = c
		return r
	}
	o := ConnectOptions{
		Transport:  rp.TrType,
		TrAddr:     rp.TrAddr,
		TrSvcID:    rp.TrSvcID,
		NQN:        tg.vol.NQN,
		HostNQN:    host.NQN,
		HostID:     host.ID,
		HostTrAddr: rp.HostTrAddr,
		HostIface:  rp.HostIface,
		Tunables:   tg.vol.Tunables,
	}
	if tg.auth != nil {
		o.DHCHAPSecret, o.DHCHAPCtrlSecret = tg.auth.Host, tg.auth.Ctrl
	}
	switch {
	case tc != nil && tc.concat:
		o.Concat = true
	case tc != nil:
		o.TLS, o.TLSKey, o.Keyring = true, tc.key, tc.keyring
	}
	s, err := o.Encode()
	if err != nil {
		r.err = err
		return r
	}
	inst, err := fabricsConnect(ctx, t.opts.FabricsDevice, s)
	if errors.Is(err, errDuplicate) {
		// Another connect (nvme-cli, a concurrent berth) won the race.
		cs, rerr := t.sys.readControllers(tg.vol.NQN)
		if rerr != nil {
			r.err = rerr
			return r
		}
		if c := find(cs); c != "" {
			if err := tg.checkReuse(c); err != nil {
				r.err = err
				return r
			}
			if err := tg.checkTLSReuse(c, tc); err != nil {
				r.err = err
				return r
			}
			r.ctrl = c
			return r
		}
		r.err = fmt.Errorf("%w, but no such controller is visible in sysfs; retry: %w", err, errdefs.ErrUnavailable)
		return r
	}
	if errors.Is(err, errRefused) && tg.authRefused(ctx, rp) {
		r.err = errAuthRefused(host.NQN)
		return r
	}
	if err != nil && tc != nil {
		err = tg.tlsConnectError(ctx, rp, err)
	}
	if err != nil {
		r.err = fmt.Errorf("%w (hostnqn %s)", err, host.NQN)
		return r
	}
	r.ctrl = fmt.Sprintf("nvme%d", inst)
	if tg.auth != nil {
		// A kernel without in-band authentication takes the keys and
		// connects without authenticating when the target asks for
		// none: such a controller must not serve the volume.
		ca, err := t.sys.readCtrlAuth(r.ctrl)
		if err == nil && !ca.supported {
			err = errNoKernelAuth(r.ctrl)
		}
		if err != nil {
			is := func(c *Controller) bool { return c.matches(tg.vol.NQN, host.NQN, rp) }
			if derr := t.sys.deleteController(tg.vol.NQN, r.ctrl, is); derr != nil {
				err = errors.Join(err, derr)
			}
			r.err = err
			return r
		}
	}
	r.created = true
	failpoint.Hit("nvmeof.connected")
	logctx.From(ctx, t.log).Info("nvmeof: connected", "target", tg.Key(), "path", p.String(), "controller", r.ctrl)
	return r
}
