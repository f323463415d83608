package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
	"github.com/berth-csi/berth/internal/kmutex"
	"github.com/berth-csi/berth/internal/logctx"
)

// DefaultNamespaceTimeout bounds the wait for a namespace device after
// its controllers are connected, when the caller's context allows more.
const DefaultNamespaceTimeout = 30 * time.Second

// Options configure a Transport. Only Listener is required for real use;
// the roots exist so that tests can point the transport at fake trees.
type Options struct {
	// Listener delivers the block device uevents Attach and Expand wait on.
	Listener *devices.Listener
	// Staged lists the volume_context (merged with publish_context, as
	// the agent persists it) of every volume the agent has staged or is
	// staging on this node, of any transport. Detach keeps a controller
	// while another volume listed here uses the same subsystem and path.
	// Without it Detach can only see other volumes of the subsystem
	// that are mounted or held open, not raw block volumes.
	Staged func(ctx context.Context) ([]map[string]string, error)
	// Host fixes the host identity; nil loads (or creates) it from HostDir.
	Host *HostIdentity
	// HostDir holds hostnqn and hostid; default DefaultHostDir.
	HostDir string
	// SysRoot is where sysfs is mounted; default "/sys".
	SysRoot string
	// DevRoot holds block device nodes; default "/dev".
	DevRoot string
	// readFile reads sysfs attributes; nil is sysfs.ReadFile (tests).
	readFile func(name string) ([]byte, error)
	// FabricsDevice is the connect interface; default DefaultFabricsDevice.
	FabricsDevice string
	// Resolver resolves target host names; default net.DefaultResolver.
	Resolver *net.Resolver
	// NamespaceTimeout bounds the wait for the namespace after connecting;
	// default DefaultNamespaceTimeout.
	NamespaceTimeout time.Duration
	// Logger receives connect and disconnect events; default slog.Default().
	Logger *slog.Logger
}

// Transport attaches NVMe over Fabrics namespaces. It is safe for
// concurrent use; operations on one subsystem are serialized.
type Transport struct {
	opts Options
	sys  sysTree
	log  *slog.Logger

	hostMu sync.Mutex
	host   *HostIdentity

	locks keyedMutex

	mu sync.Mutex
	// released holds the keys of volumes this process has detached (and
	// not attached again). Detach ignores them in Staged's answer: when
	// two volumes of one subsystem are unstaged at once, each sees the
	// other still listed, and the second must not keep the controllers
	// for the first.
	released map[string]bool
}

// NewTransport returns a transport. It does not touch the system: the
// host identity is loaded at the first Attach.
func NewTransport(opts Options) (*Transport, error) {
	if opts.HostDir == "" {
		opts.HostDir = DefaultHostDir
	}
	if opts.SysRoot == "" {
		opts.SysRoot = "/sys"
	}
	if opts.DevRoot == "" {
		opts.DevRoot = "/dev"
	}
	if opts.FabricsDevice == "" {
		opts.FabricsDevice = DefaultFabricsDevice
	}
	if opts.Resolver == nil {
		opts.Resolver = net.DefaultResolver
	}
	if opts.NamespaceTimeout <= 0 {
		opts.NamespaceTimeout = DefaultNamespaceTimeout
	}
	if opts.Host != nil {
		if err := ValidateNQN("hostnqn", opts.Host.NQN); err != nil {
			return nil, err
		}
		if err := validateUUID("hostid", opts.Host.ID); err != nil {
			return nil, err
		}
	}
	t := &Transport{opts: opts, sys: sysTree{root: opts.SysRoot, readFile: opts.readFile}, log: opts.Logger, host: opts.Host, released: make(map[string]bool)}
	if t.log == nil {
		t.log = slog.Default()
	}
	return t, nil
}

// Name is the transport's name: volume_context "transport" selects it by
// this value.
const Name = "nvmeof"

// TransportKeys returns the volume_context keys that select the NVMe-oF
// transport when volume_context has no "transport".
func TransportKeys() []string { return []string{KeyNQN, AliasTrAddr} }

// Name is the transport's volume_context "transport" value.
func (t *Transport) Name() string { return Name }

// Parse validates a volume_context and the DH-HMAC-CHAP keys in secrets
// (see ParseAuth); see the package documentation for its keys. Errors
// about a key name it, never its value.
func (t *Transport) Parse(volumeContext, secrets map[string]string) (*Target, error) {
	v, err := ParseVolumeContext(volumeContext)
	if err != nil {
		return nil, err
	}
	auth, err := ParseAuth(secrets)
	if err != nil {
		return nil, err
	}
	return &Target{t: t, vol: v, auth: auth}, nil
}

// HostIdentity returns the host NQN and ID, loading or creating them on
// first use.
func (t *Transport) HostIdentity() (HostIdentity, error) {
	t.hostMu.Lock()
	defer t.hostMu.Unlock()
	if t.host != nil {
		return *t.host, nil
	}
	id, err := LoadHostIdentity(t.opts.HostDir)
	if err != nil {
		return HostIdentity{}, err
	}
	t.host = &id
	return id, nil
}

// Target is one parsed NVMe-oF volume.
type Target struct {
	t    *Transport
	vol  *Volume
	auth *Auth // nil: no in-band authentication (or not known: Detach, Health)
}

// Volume returns the parsed volume_context.
func (g *Target) Volume() *Volume { return g.vol }

// Key is the canonical identity of the namespace (see Volume.Key).
func (g *Target) Key() string { return g.vol.Key() }

// Identity is the namespace's identity before it is attached: its key,
// subsystem NQN and namespace, which no address changes. (After the
// attach the agent also compares the device's NQN, NSID, UUID and NGUID.)
func (g *Target) Identity() (string, error) { return g.vol.Key(), nil }

func (g *Target) matcher() devices.Matcher {
	return devices.MatchNVMe(g.vol.NQN, g.vol.NSID, g.vol.UUID, g.vol.NGUID)
}

// resolve returns p with a host name replaced by its first address.
func (g *Target) resolve(ctx context.Context, p Path) (Path, error) {
	if _, err := netip.ParseAddr(p.TrAddr); err == nil {
		return p, nil
	}
	addrs, err := g.t.opts.Resolver.LookupNetIP(ctx, "ip", p.TrAddr)
	if err != nil {
		return p, fmt.Errorf("resolve target %s: %w: %w", p.TrAddr, err, errdefs.ErrUnavailable)
	}
	if len(addrs) == 0 {
		return p, fmt.Errorf("resolve target %s: no addresses: %w", p.TrAddr, errdefs.ErrUnavailable)
	}
	p.TrAddr = addrs[0].Unmap().String()
	return p, nil
}

// pathResult is the outcome of attaching one path.
type pathResult struct {
	path    Path
	rpath   Path   // path with its address resolved
	ctrl    string // controller name
	created bool
	err     error
}

// Preflight checks that the kernel's fabrics interface is there (the
// nvme-fabrics module is loaded), changing nothing.
func (g *Target) Preflight(context.Context) error {
	if g.t.opts.Listener == nil {
		return fmt.Errorf("attach %s: the transport has no device listener: %w", g.Key(), errdefs.ErrFailedPrecondition)
	}
	if _, err := os.Stat(g.t.opts.FabricsDevice); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("attach %s: %s does not exist: the nvme-fabrics module is not loaded (modprobe nvme-tcp, and add it to /etc/modules-load.d): %w", g.Key(), g.t.opts.FabricsDevice, errdefs.ErrUnavailable)
	}
	return nil
}

// Attach connects every path of the volume that has no live (or
// reconnecting) controller yet, reusing existing ones, then waits for
// the namespace device and returns it. It succeeds when at least one
// path is connected and the namespace appears; failed paths show in
// Health and are retried by the next Attach.
func (g *Target) Attach(ctx context.Context) (_ *devices.Device, retErr error) {
	t := g.t
	if t.opts.Listener == nil {
		return nil, fmt.Errorf("attach %s: the transport has no device listener: %w", g.Key(), errdefs.ErrFailedPrecondition)
	}
	host, err := t.HostIdentity()
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}
	// Connects and deletes of one subsystem are serialized; the wait
	// for the namespace below is not.
	unlock, err := t.locks.lock(ctx, g.vol.NQN)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}
	locked := true
	defer func() {
		if locked {
			unlock()
		}
	}()
	t.mu.Lock()
	delete(t.released, g.Key())
	t.mu.Unlock()

	// Subscribe before connecting so that the namespace's uevent cannot
	// be missed.
	w := t.opts.Listener.Subscribe(g.matcher())
	defer w.Close()

	ctrls, err := t.sys.readControllers(g.vol.NQN)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}
	if err := checkHostConflict(ctrls, host); err != nil {
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}
	if err := g.checkKernelAuth(ctrls); err != nil {
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}

	results := make([]pathResult, len(g.vol.Paths))
	var wg sync.WaitGroup
	for i, p := range g.vol.Paths {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = g.attachPath(ctx, host, ctrls, p)
		}()
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
		if !locked {
			u, err := t.locks.lock(cctx, g.vol.NQN)
			if err != nil {
				logctx.From(ctx, t.log).Warn("nvmeof: undo connect", "target", g.Key(), "error", err)
				return
			}
			defer u()
		}
		keep, err := g.othersNeed(cctx)
		if err != nil {
			logctx.From(ctx, t.log).Warn("nvmeof: undo connect", "target", g.Key(), "error", err)
			return
		}
		for _, r := range created {
			if keep(r.ctrl) {
				continue
			}
			is := func(c *Controller) bool { return c.matches(g.vol.NQN, host.NQN, r.rpath) }
			if err := t.sys.deleteController(g.vol.NQN, r.ctrl, is); err != nil {
				logctx.From(ctx, t.log).Warn("nvmeof: undo connect", "controller", r.ctrl, "error", err)
			}
		}
	}()
	if connected == 0 {
		return nil, fmt.Errorf("attach %s: no path connected: %w", g.Key(), errors.Join(errs...))
	}
	for _, e := range errs {
		logctx.From(ctx, t.log).Warn("nvmeof: path not connected", "target", g.Key(), "error", e)
	}

	unlock()
	locked = false
	wctx, cancel := context.WithTimeout(ctx, t.opts.NamespaceTimeout)
	defer cancel()
	dev, err := w.Wait(wctx)
	if err != nil {
		if ctx.Err() == nil && wctx.Err() != nil {
			return nil, fmt.Errorf("attach %s: connected (%d of %d paths) but no namespace appeared within %s: check nsid/uuid/nguid and that the subsystem exports the namespace to this host: %w",
				g.Key(), connected, len(g.vol.Paths), t.opts.NamespaceTimeout, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}
	if err := g.verify(dev); err != nil {
		return nil, fmt.Errorf("attach %s: %w", g.Key(), err)
	}
	return dev, nil
}

// verify checks that dev is the namespace the volume names.
func (g *Target) verify(dev *devices.Device) error {
	id := dev.ID
	switch {
	case id.Kind != devices.KindNVMe:
		return fmt.Errorf("device %s is not an NVMe namespace: %w", dev, errdefs.ErrFailedPrecondition)
	case id.NQN != g.vol.NQN:
		return fmt.Errorf("device %s belongs to subsystem %s, not %s: %w", dev, id.NQN, g.vol.NQN, errdefs.ErrFailedPrecondition)
	case g.vol.NSID != 0 && id.NSID != g.vol.NSID:
		return fmt.Errorf("device %s is namespace %d, not %d: %w", dev, id.NSID, g.vol.NSID, errdefs.ErrFailedPrecondition)
	case g.vol.UUID != "" && normalizeZeroID(id.UUID) != g.vol.UUID:
		return fmt.Errorf("device %s has UUID %q, not %s: %w", dev, id.UUID, g.vol.UUID, errdefs.ErrFailedPrecondition)
	case g.vol.NGUID != "" && normalizeZeroID(id.NGUID) != g.vol.NGUID:
		return fmt.Errorf("device %s has NGUID %q, not %s: %w", dev, id.NGUID, g.vol.NGUID, errdefs.ErrFailedPrecondition)
	}
	return dev.Verify()
}

// attachPath reuses the controller for p or connects a new one.
func (g *Target) attachPath(ctx context.Context, host HostIdentity, ctrls []Controller, p Path) pathResult {
	t := g.t
	r := pathResult{path: p}
	rp, err := g.resolve(ctx, p)
	if err != nil {
		r.err = err
		return r
	}
	r.rpath = rp
	find := func(cs []Controller) string {
		for i := range cs {
			if cs[i].matches(g.vol.NQN, host.NQN, rp) {
				return cs[i].Name
			}
		}
		return ""
	}
	if c := find(ctrls); c != "" {
		if err := g.checkReuse(c); err != nil {
			r.err = err
			return r
		}
		logctx.From(ctx, t.log).Debug("nvmeof: reusing controller", "target", g.Key(), "path", p.String(), "controller", c)
		r.ctrl = c
		return r
	}
	o := ConnectOptions{
		Transport:  rp.TrType,
		TrAddr:     rp.TrAddr,
		TrSvcID:    rp.TrSvcID,
		NQN:        g.vol.NQN,
		HostNQN:    host.NQN,
		HostID:     host.ID,
		HostTrAddr: rp.HostTrAddr,
		HostIface:  rp.HostIface,
		Tunables:   g.vol.Tunables,
	}
	if g.auth != nil {
		o.DHCHAPSecret, o.DHCHAPCtrlSecret = g.auth.Host, g.auth.Ctrl
	}
	s, err := o.Encode()
	if err != nil {
		r.err = err
		return r
	}
	inst, err := fabricsConnect(ctx, t.opts.FabricsDevice, s)
	if errors.Is(err, errDuplicate) {
		// Another connect (nvme-cli, a concurrent berth) won the race.
		cs, rerr := t.sys.readControllers(g.vol.NQN)
		if rerr != nil {
			r.err = rerr
			return r
		}
		if c := find(cs); c != "" {
			if err := g.checkReuse(c); err != nil {
				r.err = err
				return r
			}
			r.ctrl = c
			return r
		}
		r.err = fmt.Errorf("%w, but no such controller is visible in sysfs; retry: %w", err, errdefs.ErrUnavailable)
		return r
	}
	if errors.Is(err, errRefused) && g.authRefused(ctx, rp) {
		r.err = errAuthRefused(host.NQN)
		return r
	}
	if err != nil {
		r.err = fmt.Errorf("%w (hostnqn %s)", err, host.NQN)
		return r
	}
	r.ctrl = fmt.Sprintf("nvme%d", inst)
	if g.auth != nil {
		// A kernel without in-band authentication takes the keys and
		// connects without authenticating when the target asks for
		// none: such a controller must not serve the volume.
		ca, err := t.sys.readCtrlAuth(r.ctrl)
		if err == nil && !ca.supported {
			err = errNoKernelAuth(r.ctrl)
		}
		if err != nil {
			is := func(c *Controller) bool { return c.matches(g.vol.NQN, host.NQN, rp) }
			if derr := t.sys.deleteController(g.vol.NQN, r.ctrl, is); derr != nil {
				err = errors.Join(err, derr)
			}
			r.err = err
			return r
		}
	}
	r.created = true
	failpoint.Hit("nvmeof.connected")
	logctx.From(ctx, t.log).Info("nvmeof: connected", "target", g.Key(), "path", p.String(), "controller", r.ctrl)
	return r
}

// head returns the namespace device of the volume, or ok false.
func (g *Target) head() (Head, bool, error) {
	hs, err := g.t.sys.readHeads(g.vol.NQN)
	if err != nil {
		return Head{}, false, err
	}
	for _, h := range hs {
		if h.matches(g.vol) {
			return h, true, nil
		}
	}
	return Head{}, false, nil
}

// othersNeed returns a test for whether a controller must stay for
// other users of the subsystem: volumes listed by Options.Staged (other
// than this one and those this process has released) whose paths it
// serves, or, when another namespace of the subsystem is mounted or held
// open, every controller of the subsystem.
func (g *Target) othersNeed(ctx context.Context) (func(ctrl string) bool, error) {
	t := g.t
	heads, err := t.sys.readHeads(g.vol.NQN)
	if err != nil {
		return nil, err
	}
	for _, h := range heads {
		if h.matches(g.vol) {
			continue
		}
		if openedExclusively(filepath.Join(t.opts.DevRoot, h.Name)) {
			logctx.From(ctx, t.log).Debug("nvmeof: subsystem in use", "target", g.Key(), "namespace", h.Name)
			return func(string) bool { return true }, nil
		}
	}
	var others []*Volume
	if t.opts.Staged != nil {
		vcs, err := t.opts.Staged(ctx)
		if err != nil {
			return nil, fmt.Errorf("list staged volumes: %w", err)
		}
		t.mu.Lock()
		for _, vc := range vcs {
			v, err := ParseVolumeContext(vc)
			if err != nil || v.NQN != g.vol.NQN || v.Key() == g.Key() || t.released[v.Key()] {
				continue
			}
			others = append(others, v)
		}
		t.mu.Unlock()
	}
	if len(others) == 0 {
		return func(string) bool { return false }, nil
	}
	ctrls, err := t.sys.readControllers(g.vol.NQN)
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
				if ctrls[i].matches(g.vol.NQN, "", rp) {
					need[ctrls[i].Name] = true
				}
			}
		}
	}
	return func(c string) bool { return need[c] }, nil
}

// Detach flushes the namespace and deletes the volume's controllers
// that no other volume needs (see Options.Staged). It refuses while the
// namespace itself is still mounted or held open. Controllers that are
// already gone are success, so Detach can be repeated.
func (g *Target) Detach(ctx context.Context) error {
	t := g.t
	unlock, err := t.locks.lock(ctx, g.vol.NQN)
	if err != nil {
		return fmt.Errorf("detach %s: %w", g.Key(), err)
	}
	defer unlock()

	h, ok, err := g.head()
	if err != nil {
		return fmt.Errorf("detach %s: %w", g.Key(), err)
	}
	if ok {
		dev := filepath.Join(t.opts.DevRoot, h.Name)
		if openedExclusively(dev) {
			return fmt.Errorf("detach %s: %s is still mounted or held open: %w", g.Key(), dev, errdefs.ErrBusy)
		}
		if err := flushDevice(dev); err != nil {
			return fmt.Errorf("detach %s: %w", g.Key(), err)
		}
		failpoint.Hit("nvmeof.flushed")
	}
	t.mu.Lock()
	t.released[g.Key()] = true
	t.mu.Unlock()

	keep, err := g.othersNeed(ctx)
	if err != nil {
		return fmt.Errorf("detach %s: %w", g.Key(), err)
	}
	if err := g.deleteControllers(ctx, keep); err != nil {
		return fmt.Errorf("detach %s: %w", g.Key(), err)
	}
	return nil
}

// deleteControllers deletes the controllers of the volume's paths, but
// those keep names.
func (g *Target) deleteControllers(ctx context.Context, keep func(ctrl string) bool) error {
	t := g.t
	ctrls, err := t.sys.readControllers(g.vol.NQN)
	if err != nil {
		return err
	}
	var host string
	if id, err := t.HostIdentity(); err == nil {
		host = id.NQN
	}
	var errs []error
	for _, p := range g.vol.Paths {
		rp, rerr := g.resolve(ctx, p)
		for i := range ctrls {
			c := &ctrls[i]
			var match bool
			if rerr == nil {
				match = c.matches(g.vol.NQN, host, rp)
			} else {
				// The name does not resolve now: take every controller
				// of the subsystem at that port.
				match = !c.Deleting() && c.SubsysNQN == g.vol.NQN && c.Transport == p.TrType &&
					samePort(c.Address.TrSvcID, p.TrSvcID) && (host == "" || c.HostNQN == host)
			}
			if !match {
				continue
			}
			if keep(c.Name) {
				logctx.From(ctx, t.log).Debug("nvmeof: keeping controller for other volumes", "target", g.Key(), "controller", c.Name)
				continue
			}
			is := func(cur *Controller) bool { return cur.same(c) }
			if err := t.sys.deleteController(g.vol.NQN, c.Name, is); err != nil {
				errs = append(errs, err)
				continue
			}
			logctx.From(ctx, t.log).Info("nvmeof: disconnected", "target", g.Key(), "path", p.String(), "controller", c.Name)
			failpoint.Hit("nvmeof.disconnected")
		}
	}
	return errors.Join(errs...)
}

// StopQueueing makes the namespace's head fail I/O when none of the
// subsystem's controllers is live. While a controller reconnects (with
// ctrl_loss_tmo -1, forever), the head queues I/O for it, and an unmount
// of its filesystem waits in the kernel; once the subsystem has no
// controller left, the head fails its queued and new I/O. So the volume's
// controllers are deleted now, as Detach would delete them after the
// unmount. Controllers that other volumes need stay (see othersNeed): the
// head then queues on until they reconnect or the other volumes let them
// go. A head with a live controller is left as it is.
func (g *Target) StopQueueing(ctx context.Context) (bool, error) {
	t := g.t
	unlock, err := t.locks.lock(ctx, g.vol.NQN)
	if err != nil {
		return false, fmt.Errorf("%s: %w", g.Key(), err)
	}
	defer unlock()
	h, ok, err := g.head()
	if err != nil || !ok {
		return false, err
	}
	ctrls, err := t.sys.readControllers(g.vol.NQN)
	if err != nil {
		return false, fmt.Errorf("%s: %w", g.Key(), err)
	}
	var states []string
	for _, c := range ctrls {
		if c.SubsysNQN != g.vol.NQN || c.Deleting() {
			continue
		}
		if c.State == StateLive {
			return false, nil
		}
		states = append(states, c.Name+" "+c.State)
	}
	keep, err := g.othersNeed(ctx)
	if err != nil {
		return false, fmt.Errorf("%s: %w", g.Key(), err)
	}
	logctx.From(ctx, t.log).Warn("nvmeof: no controller is live; deleting the volume's controllers so that its namespace fails I/O instead of queueing it",
		"target", g.Key(), "namespace", h.Name, "controllers", strings.Join(states, ", "))
	if err := g.deleteControllers(ctx, keep); err != nil {
		return false, fmt.Errorf("%s: %w", g.Key(), err)
	}
	return true, nil
}

// expandSettle bounds how long Expand, which does not know the size to
// expect, waits for a size change after asking for a rescan when no
// controller answers an Identify Namespace command.
const expandSettle = time.Second

// expandRescanWait bounds how long Expand waits for the kernel to take a
// size a controller already reports (a rescan takes milliseconds).
const expandRescanWait = 10 * time.Second

// Expand returns the namespace's size as its controller reports it now.
// It asks a live controller (Identify Namespace): when the kernel already
// has that size it returns at once; when the target grew, it asks the
// controllers to rescan and returns once the kernel shows the new size.
// A caller that knows the size it needs should use ExpandTo, which waits
// for exactly that.
func (g *Target) Expand(ctx context.Context) (int64, error) {
	return g.expand(ctx, 0)
}

// ExpandTo waits until the namespace reports at least minBytes. Targets
// announce a new size by an asynchronous event (AEN); the kernel then
// changes the device's size and sends a "change" uevent. ExpandTo
// subscribes to those events, checks sysfs once, asks live controllers
// to rescan (for targets that send no AEN), then waits until ctx ends.
func (g *Target) ExpandTo(ctx context.Context, minBytes int64) (int64, error) {
	if minBytes <= 0 {
		return 0, fmt.Errorf("expand %s: required size %d: %w", g.Key(), minBytes, errdefs.ErrInvalidArgument)
	}
	return g.expand(ctx, minBytes)
}

func (g *Target) expand(ctx context.Context, minBytes int64) (int64, error) {
	t := g.t
	if t.opts.Listener == nil {
		return 0, fmt.Errorf("expand %s: the transport has no device listener: %w", g.Key(), errdefs.ErrFailedPrecondition)
	}
	h, ok, err := g.head()
	if err != nil {
		return 0, fmt.Errorf("expand %s: %w", g.Key(), err)
	}
	if !ok {
		return 0, fmt.Errorf("expand %s: namespace not attached: %w", g.Key(), errdefs.ErrNotFound)
	}
	var live []string
	if paths, err := t.sys.readNamespacePaths(h.Name); err == nil {
		ctrls, _ := t.sys.readControllers(g.vol.NQN)
		for _, p := range paths {
			for _, c := range ctrls {
				if c.Name == p.Controller && c.State == StateLive {
					live = append(live, c.Name)
				}
			}
		}
	}
	// Without a size to wait for, the controller says which: the target's
	// size now, which the kernel has or takes with the rescan below.
	reported := false
	if minBytes <= 0 {
		if size, err := g.reportedSize(live, h); err == nil {
			minBytes, reported = size, true
		} else {
			logctx.From(ctx, t.log).Debug("nvmeof: expand: no controller reported the namespace's size; waiting for a change instead", "target", g.Key(), "error", err)
		}
	}
	sizeOf := func() (int64, error) { return t.sys.readSize(filepath.Join(t.sys.root, "block", h.Name)) }
	// Subscribe first, then read: a change between the two is not lost.
	m := &sizeMatcher{name: h.Name, min: minBytes, not: -1}
	w := t.opts.Listener.Subscribe(m)
	defer w.Close()
	size, err := sizeOf()
	if err != nil {
		return 0, fmt.Errorf("expand %s: %w", g.Key(), err)
	}
	if minBytes > 0 && size >= minBytes {
		return size, nil
	}
	m.setNot(size)
	for _, c := range live {
		if err := t.sys.rescanController(c); err != nil {
			logctx.From(ctx, t.log).Debug("nvmeof: rescan", "controller", c, "error", err)
		}
	}
	start := time.Now()
	if minBytes <= 0 {
		wctx, cancel := context.WithTimeout(ctx, expandSettle)
		defer cancel()
		if dev, err := w.Wait(wctx); err == nil {
			return dev.Size, nil
		} else if ctx.Err() != nil {
			return 0, fmt.Errorf("expand %s: %w", g.Key(), err)
		}
		return sizeOf()
	}
	if reported {
		wctx, cancel := context.WithTimeout(ctx, expandRescanWait)
		defer cancel()
		dev, err := w.Wait(wctx)
		if err == nil {
			return dev.Size, nil
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("expand %s: %w", g.Key(), err)
		}
		cur, err := sizeOf()
		if err != nil {
			return 0, fmt.Errorf("expand %s: %w", g.Key(), err)
		}
		logctx.From(ctx, t.log).Warn("nvmeof: expand: the controller reports a size the kernel has not taken after a rescan", "target", g.Key(),
			"device", h.Name, "reported_bytes", minBytes, "device_bytes", cur, "waited", time.Since(start).Round(time.Millisecond))
		return cur, nil
	}
	dev, err := w.Wait(ctx)
	if err != nil {
		if ctx.Err() != nil {
			cur, _ := sizeOf()
			return cur, fmt.Errorf("expand %s: namespace %s still reports %d bytes after %s, want %d; the target has not announced the new size: %w",
				g.Key(), h.Name, cur, time.Since(start).Round(time.Millisecond), minBytes, errdefs.ErrUnavailable)
		}
		return 0, fmt.Errorf("expand %s: %w", g.Key(), err)
	}
	return dev.Size, nil
}

// reportedSize asks the live controllers ctrls, one after another until
// one answers, for the size of the namespace h.
func (g *Target) reportedSize(ctrls []string, h Head) (int64, error) {
	if len(ctrls) == 0 {
		return 0, fmt.Errorf("namespace %s: no live controller", h.Name)
	}
	var errs []error
	for _, c := range ctrls {
		size, err := identifyNamespaceSize(g.t.opts.DevRoot, c, h.NSID)
		if err == nil {
			return size, nil
		}
		errs = append(errs, err)
	}
	return 0, errors.Join(errs...)
}

// sizeMatcher matches a block device once it has at least min bytes
// (min > 0) or a size other than not (min == 0).
type sizeMatcher struct {
	name string
	min  int64
	mu   sync.Mutex
	not  int64 // -1: not known yet, matches nothing
}

func (m *sizeMatcher) setNot(n int64) {
	m.mu.Lock()
	m.not = n
	m.mu.Unlock()
}

func (m *sizeMatcher) Match(d *devices.Device) bool {
	if d == nil || d.Name != m.name {
		return false
	}
	if m.min > 0 {
		return d.Size >= m.min
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.not >= 0 && d.Size != m.not
}

func (m *sizeMatcher) String() string {
	if m.min > 0 {
		return fmt.Sprintf("%s with at least %d bytes", m.name, m.min)
	}
	return fmt.Sprintf("%s with a new size", m.name)
}

// PathStatus is the state of one path of a volume.
type PathStatus struct {
	Path       string // "tcp:10.0.0.5:4420"; "" for a path the volume did not ask for
	Controller string // "nvme3", "" when no controller exists
	State      string // controller state: live, connecting, resetting, ...
	// Device is the path's namespace device (nvme0c3n1, or the
	// namespace itself without multipath); "" when the namespace is not
	// visible through this controller.
	Device   string
	ANAState string // optimized, non-optimized, inaccessible, ...; "" without ANA
	// DHCHAP: the controller was connected with a DH-HMAC-CHAP key, so
	// every reconnect authenticates again with that key.
	DHCHAP bool
}

// Healthy reports whether I/O can use this path.
func (s PathStatus) Healthy() bool {
	return s.State == StateLive && s.Device != "" &&
		(s.ANAState == "" || s.ANAState == "optimized" || s.ANAState == "non-optimized")
}

func (s PathStatus) String() string {
	p := s.Path
	if p == "" {
		p = "extra path"
	}
	if s.Controller == "" {
		return p + ": no controller"
	}
	st := p + " (" + s.Controller + "): " + s.State
	if s.Device == "" {
		st += ", namespace not visible"
	}
	if s.ANAState != "" {
		st += ", " + s.ANAState
	}
	if s.DHCHAP && s.State != StateLive {
		// The kernel does not say why a reconnect failed (dmesg
		// aside); with authentication a changed key is one reason.
		st += " (connected with DH-HMAC-CHAP: reconnects fail while the target's key for this host differs from the key the controller was connected with; if the key was changed on the target, unstage every volume of the subsystem on this node and stage with the new key)"
	}
	return st
}

// Status returns the namespace device name and the state of every path
// the volume asked for, plus any other path of the namespace.
func (g *Target) Status(ctx context.Context) (head string, paths []PathStatus, err error) {
	t := g.t
	h, ok, err := g.head()
	if err != nil {
		return "", nil, err
	}
	ctrls, err := t.sys.readControllers(g.vol.NQN)
	if err != nil {
		return "", nil, err
	}
	nsPath := make(map[string]NamespacePath) // by controller
	var nsPaths []NamespacePath
	if ok {
		head = h.Name
		if nsPaths, err = t.sys.readNamespacePaths(h.Name); err != nil {
			return "", nil, err
		}
		for _, p := range nsPaths {
			nsPath[p.Controller] = p
		}
	}
	var hostNQN string
	if id, err := t.HostIdentity(); err == nil {
		hostNQN = id.NQN
	}
	seen := make(map[string]bool)
	for _, p := range g.vol.Paths {
		st := PathStatus{Path: p.String()}
		if rp, err := g.resolve(ctx, p); err == nil {
			for i := range ctrls {
				if c := &ctrls[i]; c.matches(g.vol.NQN, hostNQN, rp) {
					np := nsPath[c.Name]
					st.Controller, st.State, st.Device, st.ANAState = c.Name, c.State, np.Name, np.ANAState
					if ca, err := t.sys.readCtrlAuth(c.Name); err == nil {
						st.DHCHAP = ca.host != ""
					}
					seen[c.Name] = true
					break
				}
			}
		}
		paths = append(paths, st)
	}
	for _, p := range nsPaths {
		if seen[p.Controller] {
			continue
		}
		st := PathStatus{Controller: p.Controller, Device: p.Name, ANAState: p.ANAState}
		if i := slices.IndexFunc(ctrls, func(c Controller) bool { return c.Name == p.Controller }); i >= 0 {
			st.State = ctrls[i].State
		}
		paths = append(paths, st)
	}
	return head, paths, nil
}

// PathStates counts the paths the volume asked for by state, for
// metrics: the controller state ("live", "connecting", "resetting", ...),
// "missing" for a path without a controller, "no-namespace" for a live
// controller that does not show the namespace, and for a live path whose
// ANA group is not usable its ANA state ("inaccessible", ...).
func (g *Target) PathStates(ctx context.Context) (map[string]int, error) {
	_, paths, err := g.Status(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int)
	for _, p := range paths {
		switch {
		case p.Path == "":
			continue
		case p.Controller == "":
			out["missing"]++
		case p.State == StateLive && p.Device == "":
			out["no-namespace"]++
		case p.State == StateLive && !p.Healthy():
			out[p.ANAState]++
		default:
			out[p.State]++
		}
	}
	return out, nil
}

// Health reports the volume abnormal when its namespace is gone or any
// path it asked for is not live or not ANA-accessible; the message
// lists every path.
func (g *Target) Health(ctx context.Context) (abnormal bool, message string) {
	head, paths, err := g.Status(ctx)
	if err != nil {
		return true, err.Error()
	}
	if head == "" {
		return true, fmt.Sprintf("namespace of %s not attached: no controller of the subsystem is connected; %s", g.Key(), goneControllerHint)
	}
	var parts []string
	up, want := 0, 0
	for _, p := range paths {
		parts = append(parts, p.String())
		if p.Path == "" {
			continue
		}
		want++
		if p.Healthy() {
			up++
		}
	}
	msg := fmt.Sprintf("%s: %d of %d paths up: %s", head, up, want, strings.Join(parts, "; "))
	for _, p := range paths {
		if p.Path != "" && p.Controller == "" {
			msg += " (" + goneControllerHint + ")"
			break
		}
	}
	return up < want, msg
}

// goneControllerHint explains a path without a controller. The kernel
// deletes a controller whose reconnects gave up; 6.12 (measured) also
// deletes one whose reconnect failed DH-HMAC-CHAP authentication (a
// status with Do Not Retry), at the first such attempt.
const goneControllerHint = "the kernel removes a controller whose reconnects gave up (ctrl_loss_tmo) or, for a volume staged with DH-HMAC-CHAP keys, whose reconnect failed authentication (the target's key for this host changed or was removed): check the target, then unstage and stage the volume again"

// keyedMutex serializes operations per key (a subsystem NQN).
type keyedMutex struct{ k kmutex.KeyedMutex }

func (m *keyedMutex) lock(ctx context.Context, key string) (func(), error) {
	unlock, err := m.k.Lock(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("wait for another operation on subsystem %s: %w", key, err)
	}
	return unlock, nil
}
