package iscsi

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/kmutex"
	"github.com/berth-csi/berth/internal/sysfs"
)

// Options configures the iSCSI transport of a node.
type Options struct {
	// Iscsiadm is the iscsiadm executable, or a wrapper that runs the
	// host's iscsiadm (see the package documentation). Default "iscsiadm".
	Iscsiadm string
	// Multipathd is the multipathd executable or wrapper. Default
	// "multipathd".
	Multipathd string
	// NodeDir is open-iscsi's node record directory; "" finds it
	// (/etc/iscsi/nodes, then /var/lib/iscsi/nodes).
	NodeDir string
	// LockDir is open-iscsi's lock directory. Default /run/lock/iscsi.
	LockDir string
	// InitiatorNameFile is checked before a login. Default
	// /etc/iscsi/initiatorname.iscsi.
	InitiatorNameFile string
	// Sys is the sysfs tree; the zero value is /sys.
	Sys sysfs.Root
	// DevRoot holds block device nodes. Default /dev.
	DevRoot string
	// Params are node-wide session parameters (Param* names), applied to
	// every new node record; a volume's own values win.
	Params map[string]int
	// Listener receives the kernel's block device events.
	Listener *devices.Listener
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Transport attaches iSCSI volumes through open-iscsi. It is safe for
// concurrent use; logins, scans, disk removals and logouts of the same
// session (target, portal, interface) are serialized, across the berths
// of the node too (see pathLock), so that a LUN
// scanned in by one volume is never logged out from under it by another
// (the waits for the LUNs' disks overlap). One LUN must not be attached
// or detached by two callers at once: the agent's per-storage locks see
// to that.
type Transport struct {
	opts Options
	log  *slog.Logger
	sys  sysTree
	// devs are the trees block devices are read from.
	devs  devices.Roots
	db    recordDB
	run   runner
	locks kmutex.KeyedMutex
	// removals are the disk deletions in flight.
	removals inflight
	// testHookDiskWait, when set, runs before an attach waits for the
	// disk of the LUN it scanned in or found.
	testHookDiskWait func(lun int)
	// testHookDiscovered, when set, runs when a discovery has its answer,
	// before its record is deleted.
	testHookDiscovered func()
	// testHookLoggingOut, when set, runs when a detach found a session
	// without LUNs, before it logs out.
	testHookLoggingOut func()

	silentMu sync.Mutex
	// silent holds, for each path key, when a login through it last
	// timed out (see silentSince).
	silent map[string]time.Time
}

// New returns the transport. It does not touch the node: readiness is
// checked when a volume is attached.
func New(opts Options) (*Transport, error) {
	if opts.Iscsiadm == "" {
		opts.Iscsiadm = "iscsiadm"
	}
	if opts.Multipathd == "" {
		opts.Multipathd = "multipathd"
	}
	if opts.InitiatorNameFile == "" {
		opts.InitiatorNameFile = "/etc/iscsi/initiatorname.iscsi"
	}
	if opts.DevRoot == "" {
		opts.DevRoot = "/dev"
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	for name, v := range opts.Params {
		r, ok := paramRanges[name]
		if !ok {
			return nil, fmt.Errorf("iSCSI parameter %q: unknown: %w", name, errdefs.ErrInvalidArgument)
		}
		if v < r[0] || v > r[1] {
			return nil, fmt.Errorf("iSCSI parameter %q: %d is out of range %d-%d: %w", name, v, r[0], r[1], errdefs.ErrInvalidArgument)
		}
	}
	if opts.Listener == nil {
		return nil, fmt.Errorf("iscsi.New: a device listener is required: %w", errdefs.ErrInvalidArgument)
	}
	lockDir := opts.LockDir
	if lockDir == "" {
		lockDir = defaultLockDir
	}
	walks := &recordWalks{dir: lockDir}
	return &Transport{
		opts: opts,
		log:  opts.Logger,
		sys:  sysTree{root: opts.Sys},
		devs: devices.Roots{Sys: opts.Sys, Dev: opts.DevRoot},
		db:   recordDB{nodes: opts.NodeDir, lockDir: opts.LockDir, walks: walks},
		run:  recordsRunner{runner: execRunner{}, iscsiadm: opts.Iscsiadm, walks: walks},
	}, nil
}

// Name is the transport's name: volume_context "transport" selects it by
// this value.
const Name = "iscsi"

// TransportKeys returns the volume_context keys that select the iSCSI
// transport when volume_context has no "transport".
func TransportKeys() []string { return []string{KeyIQN, KeyTargetPortal} }

// Name is the transport's name in volume_context "transport".
func (t *Transport) Name() string { return Name }

// Parse validates volume_context and secrets; see ParseVolume.
func (t *Transport) Parse(volumeContext, secrets map[string]string) (*Target, error) {
	v, err := ParseVolume(volumeContext, secrets)
	if err != nil {
		return nil, err
	}
	return &Target{t: t, v: v}, nil
}

// Target is one volume's LUN.
type Target struct {
	t *Transport
	v *Volume
	// requeue is the multipath map that StopQueueing made fail I/O
	// while it queued before, for ResumeQueueing.
	requeue *devices.Device
}

// Key is the canonical identity of the LUN.
func (tg *Target) Key() string { return tg.v.Key() }

// Identity is the LUN's identity before it is attached (see
// Volume.Identity). After the attach the agent also compares the device's
// WWID.
func (tg *Target) Identity() (string, error) { return tg.v.Identity(), nil }

// Volume returns the parsed volume.
func (tg *Target) Volume() *Volume { return tg.v }

// path is one portal of a volume, resolved.
type path struct {
	Portal
	IP string
}

func (p path) key(target, iface string) string {
	return target + "|" + net.JoinHostPort(p.IP, fmt.Sprint(p.Port)) + "|" + iface
}

func (p path) String() string {
	if p.Host == p.IP {
		return net.JoinHostPort(p.IP, fmt.Sprint(p.Port))
	}
	return fmt.Sprintf("%s (%s)", net.JoinHostPort(p.Host, fmt.Sprint(p.Port)), p.IP)
}

// resolve turns the portals into IP addresses: sysfs and node records know
// portals only by address. A name resolving to several addresses uses the
// first, IPv4 preferred, as iscsiadm does.
func resolve(ctx context.Context, portals []Portal) ([]path, []error) {
	var out []path
	var errs []error
	for _, p := range portals {
		if ip := net.ParseIP(p.Host); ip != nil {
			out = append(out, path{Portal: p, IP: p.Host})
			continue
		}
		addrs, err := net.DefaultResolver.LookupIPAddr(ctx, p.Host)
		if err != nil || len(addrs) == 0 {
			errs = append(errs, errdefs.Unavailable("resolve iSCSI portal %s: %v", p.Host, err))
			continue
		}
		best := addrs[0].IP
		for _, a := range addrs {
			if a.IP.To4() != nil {
				best = a.IP
				break
			}
		}
		out = append(out, path{Portal: p, IP: canonicalIP(best.String())})
	}
	return out, errs
}
