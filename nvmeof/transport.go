package nvmeof

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/keyring"
	"github.com/berth-csi/berth/internal/kmutex"
	"github.com/berth-csi/berth/internal/sysfs"
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
	// Sys is the sysfs tree; the zero value is /sys.
	Sys sysfs.Root
	// DevRoot holds block device nodes; default "/dev".
	DevRoot string
	// readFile reads sysfs attributes; nil is sysfs.ReadFile (tests).
	readFile func(name string) ([]byte, error)
	// listKeys lists the kernel's keys; nil is keyring.List (tests).
	listKeys func() ([]keyring.Key, error)
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

	locks kmutex.KeyedMutex
	// flushing holds a key for each namespace device whose flush is in
	// flight (see flush).
	flushing kmutex.KeyedMutex

	// optNames holds the names of the kernel's connect options, read
	// under optsMu at the first TLS stage that could read them.
	optsMu   sync.Mutex
	optNames map[string]bool
	// keyMu serializes the keyring work of every subsystem: two
	// add_key calls that each find no "berth" keyring would make two,
	// the second displacing the first (and the keys in it) from .nvme.
	keyMu sync.Mutex

	mu sync.Mutex
	// released holds the keys of volumes this process has detached (and
	// not attached again). Detach ignores them in Staged's answer: when
	// two volumes of one subsystem are unstaged at once, each sees the
	// other still listed, and the second must not keep the controllers
	// for the first.
	released map[string]bool
	// stopping holds the keys of volumes whose unstage found no live
	// controller of their subsystem (StopQueueing) and that were not
	// attached again: othersNeed keeps no controller for them.
	stopping map[string]bool
	// silent holds, for each subsystem NQN and path, when a connect
	// through the path last found it silent (errSilent); see
	// skipSilent.
	silent map[string]time.Time
}

// NewTransport returns a transport. It does not touch the system: the
// host identity is loaded at the first Attach.
func NewTransport(opts Options) (*Transport, error) {
	if opts.HostDir == "" {
		opts.HostDir = DefaultHostDir
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
	t := &Transport{opts: opts, sys: sysTree{root: opts.Sys, readFile: opts.readFile}, log: opts.Logger, host: opts.Host, released: make(map[string]bool), stopping: make(map[string]bool), silent: make(map[string]time.Time)}
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

// Parse validates a volume_context, the DH-HMAC-CHAP keys in secrets
// (see ParseAuth) and the TLS PSK (see ParseTLSSecret); see the package documentation for its keys. Errors
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
	key, err := ParseTLSSecret(v, secrets)
	if err != nil {
		return nil, err
	}
	return &Target{t: t, vol: v, auth: auth, tlsKey: key}, nil
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

// knownHostNQN is the host NQN for a caller that only looks (Health,
// PathStates): the identity already loaded, else what the host's files
// hold, read without creating them (ReadHostIdentity). "" when none is
// known: controllers of any host then match.
func (t *Transport) knownHostNQN() string {
	t.hostMu.Lock()
	host := t.host
	t.hostMu.Unlock()
	if host != nil {
		return host.NQN
	}
	id, err := ReadHostIdentity(t.opts.HostDir)
	if err != nil {
		return ""
	}
	return id.NQN
}

// Target is one parsed NVMe-oF volume.
type Target struct {
	t    *Transport
	vol  *Volume
	auth *Auth // nil: no in-band authentication (or not known: Detach, Health)
	// tlsKey is the PSK of the stage secrets for a TLS volume; nil
	// for a key of the .nvme keyring (or not known: Detach, Health).
	tlsKey *TLSKey
}

// Volume returns the parsed volume_context.
func (tg *Target) Volume() *Volume { return tg.vol }

// Key is the canonical identity of the namespace (see Volume.Key).
func (tg *Target) Key() string { return tg.vol.Key() }

// Identity is the namespace's identity before it is attached: its key,
// subsystem NQN and namespace, which no address changes. (After the
// attach the agent also compares the device's NQN, NSID, UUID and NGUID.)
func (tg *Target) Identity() (string, error) { return tg.vol.Key(), nil }

func (tg *Target) matcher() devices.Matcher {
	return devices.MatchNVMe(tg.vol.NQN, tg.vol.NSID, tg.vol.UUID, tg.vol.NGUID)
}

// resolve returns p with a host name replaced by its first address.
func (tg *Target) resolve(ctx context.Context, p Path) (Path, error) {
	if _, err := netip.ParseAddr(p.TrAddr); err == nil {
		return p, nil
	}
	addrs, err := tg.t.opts.Resolver.LookupNetIP(ctx, "ip", p.TrAddr)
	if err != nil {
		return p, fmt.Errorf("resolve target %s: %w: %w", p.TrAddr, err, errdefs.ErrUnavailable)
	}
	if len(addrs) == 0 {
		return p, fmt.Errorf("resolve target %s: no addresses: %w", p.TrAddr, errdefs.ErrUnavailable)
	}
	p.TrAddr = addrs[0].Unmap().String()
	return p, nil
}

// head returns the namespace device of the volume, or ok false.
func (tg *Target) head() (Head, bool, error) {
	hs, err := tg.t.sys.readHeads(tg.vol.NQN)
	if err != nil {
		return Head{}, false, err
	}
	for _, h := range hs {
		if h.matches(tg.vol) {
			return h, true, nil
		}
	}
	return Head{}, false, nil
}
