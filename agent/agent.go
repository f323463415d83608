// Package agent serves the CSI Identity and Node services of berth over
// a unix socket, and berth controller's Identity and Controller services
// (Controller: ControllerPublishVolume only). It validates requests,
// serialises operations per volume, keeps per-volume state on disk and
// composes the transports (file, nvmeof, iscsi), package devices and
// package fs into the CSI volume lifecycle. It is the only package that maps berth's errors to gRPC
// status codes (see Code).
//
// berth implements CSI spec v1.12.0, not v1.13.0: v1.13.0 removed
// VolumeCondition from NodeGetVolumeStatsResponse, which kubelet still
// reads to report volume health; v1.12.0 keeps it.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/lockfile"
)

// DefaultDriverName is the CSI driver name berth registers with kubelet.
const DefaultDriverName = "berth.csi.io"

// Config is everything an Agent needs. Zero values get defaults where a
// default is documented.
type Config struct {
	// DriverName is reported by GetPluginInfo; default DefaultDriverName.
	DriverName string
	// Version is reported as vendor_version.
	Version string
	// NodeID is reported by NodeGetInfo. Required.
	NodeID string
	// StateDir holds the per-volume records (StateDir/volumes), the
	// marks of the filesystems berth staged (StateDir/filesystems) and
	// the volumes' trim locks (StateDir/trim). Required.
	StateDir string
	// MaxVolumes is the number of volumes this node may have staged;
	// 0 means no limit.
	MaxVolumes int64
	// Topology is the node's accessible topology (key=value segments).
	Topology map[string]string
	// Logger receives the agent's and the requests' logs; default
	// slog.Default().
	Logger *slog.Logger

	// Listener is the uevent listener shared by the transports. If nil,
	// New opens one and Serve closes it.
	Listener *devices.Listener
	// Transports are the transports this node serves.
	Transports []Transport
	// Disabled declares the transports berth knows that this node does
	// not serve, so that a volume_context with their keys is refused as
	// naming a transport not enabled here rather than as naming none.
	Disabled []TransportKind

	// Interceptors run around every RPC after berth's own logging one
	// (metrics, tracing).
	Interceptors []grpc.UnaryServerInterceptor
	// ReadyFunc, if set, is consulted by Probe once the agent is ready;
	// an error makes Probe fail with FailedPrecondition and its message.
	ReadyFunc func(context.Context) error
	// OnReady is called once state is loaded, the uevent listener runs
	// and the gRPC server accepts calls (sd_notify READY=1).
	OnReady func()
	// OnStopping is called when Serve begins to shut down
	// (sd_notify STOPPING=1).
	OnStopping func()
	// ShutdownTimeout bounds how long Serve waits, when ctx ends, for
	// the RPCs in flight and the steps they left running in the kernel;
	// default 30s. Then the remaining ones are cut.
	ShutdownTimeout time.Duration
	// TrimInterval, if positive, makes Serve trim the filesystem of every
	// staged mount volume once per interval (see trimLoop); 0: never.
	TrimInterval time.Duration
	// OnTrim, if set, is called with the result of each periodic trim
	// (metrics).
	OnTrim func(TrimResult)
	// Takeover are asked, in order, whether a volume another node holds
	// at the target has moved to this node (see TakeoverAuthority); the
	// first that allows it decides. None: a stage never takes a volume
	// over.
	Takeover []TakeoverAuthority
	// HolderName, if set, names the node whose key (NodeKey) a
	// reservation key is, "" when it cannot; messages name the key
	// either way. It answers at once, from what it knows:
	// NodeGetVolumeStats and the metrics ask it.
	HolderName func(key uint64) string
}

// Agent is a configured CSI node plugin. Create it with New, run it with
// Serve.
type Agent struct {
	cfg         Config
	log         *slog.Logger
	host        hostFS
	crypt       cryptHost
	state       *store
	marks       *fsMarks
	locks       *inflight
	transports  map[string]Transport
	implied     map[string]string // volume_context key -> transport it selects
	listener    *devices.Listener
	ownListener bool
	stateLock   *lockfile.Lock
	ready       atomic.Bool
	left        leftRunning // steps calls left running; Serve waits for them

	// verify re-checks that a device name still means the device found
	// (devices.Device.Verify); lookup reads a device from sysfs
	// (devices.Lookup). Tests substitute them.
	verify func(*devices.Device) error
	lookup func(name string) (*devices.Device, error)
	// pr issues the persistent-reservation commands of fencing.
	pr prHost
	// paths are the registered paths of the fenced multipath volumes
	// (watchPaths).
	paths pathBook
	// undoTimeout bounds the undo of a failed call (undoContext); 0
	// means defaultUndoTimeout. Tests shorten it.
	undoTimeout time.Duration
}

// defaultUndoTimeout bounds how long a failed call goes on undoing its
// partial work (a detach: a logout, a loop device's release) after the
// failure, which may be its caller's deadline. Undo normally takes
// milliseconds to a few seconds.
const defaultUndoTimeout = 10 * time.Second

// undoContext is the context in which a failed call undoes its partial
// work: not cancelled with the call, since a call cut short by its
// caller's deadline must still undo what it did, but bounded, so that
// the volume's lock is released soon after the caller gave up. An undo
// cut short leaves the volume's record, from which a retried call or
// NodeUnstageVolume finishes the work.
func (a *Agent) undoContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d := a.undoTimeout
	if d <= 0 {
		d = defaultUndoTimeout
	}
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}

var (
	driverNameRe  = regexp.MustCompile(`^[a-zA-Z0-9]([a-zA-Z0-9.-]{0,61}[a-zA-Z0-9])?$`)
	topologyKeyRe = regexp.MustCompile(`^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$`)
	topologyValRe = regexp.MustCompile(`^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$`)
)

// New checks cfg, locks cfg.StateDir, loads the state of every volume
// from it and opens the uevent listener. The lock (StateDir/lock) keeps a
// second agent from staging the same volumes; it is held until Close, and
// a second New on the directory fails, naming the holder's pid.
func New(cfg Config) (_ *Agent, retErr error) {
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if !driverNameRe.MatchString(cfg.DriverName) {
		return nil, fmt.Errorf("driver name %q: want a domain name of at most 63 characters", cfg.DriverName)
	}
	if cfg.NodeID == "" || len(cfg.NodeID) > 256 || hasControl(cfg.NodeID) {
		return nil, fmt.Errorf("node ID %q: want 1 to 256 printable bytes", cfg.NodeID)
	}
	if cfg.StateDir == "" || !filepath.IsAbs(cfg.StateDir) {
		return nil, fmt.Errorf("state directory %q: want an absolute path", cfg.StateDir)
	}
	if cfg.MaxVolumes < 0 {
		return nil, fmt.Errorf("max volumes %d: negative", cfg.MaxVolumes)
	}
	for k, v := range cfg.Topology {
		if !topologyKeyRe.MatchString(k) || !topologyValRe.MatchString(v) {
			return nil, fmt.Errorf("topology %s=%s: want a Kubernetes label key and value", k, v)
		}
	}
	cfg.Topology = maps.Clone(cfg.Topology)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 30 * time.Second
	}
	if cfg.TrimInterval < 0 {
		return nil, fmt.Errorf("trim interval %v: negative", cfg.TrimInterval)
	}
	a := &Agent{
		cfg:        cfg,
		log:        cfg.Logger,
		host:       newHostFS(),
		locks:      newInflight(),
		transports: make(map[string]Transport),
		listener:   cfg.Listener,
		verify:     (*devices.Device).Verify,
		pr:         kernelPR{},
	}
	lock, err := lockStateDir(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	a.stateLock = lock
	defer func() {
		if retErr != nil {
			a.Close()
		}
	}()
	st, err := openStore(filepath.Join(cfg.StateDir, "volumes"))
	if err != nil {
		return nil, err
	}
	a.state = st
	if a.marks, err = openFSMarks(filepath.Join(cfg.StateDir, "filesystems")); err != nil {
		return nil, err
	}
	damaged := st.damagedFiles()
	for _, p := range slices.Sorted(maps.Keys(damaged)) {
		if newer := (*newerFormatError)(nil); errors.As(damaged[p], &newer) {
			a.log.Error("a volume's state file was written by a newer berth: it is kept as it is, and the volume's calls are refused (FAILED_PRECONDITION) until a berth that reads its format runs",
				slog.String("file", p), slog.String("error", damaged[p].Error()))
			continue
		}
		a.log.Error("a volume's state file cannot be read: it is kept, and the volume's calls are refused until it is restored or moved aside (check the node for the volume's mounts and device first)",
			slog.String("file", p), slog.String("error", damaged[p].Error()))
	}
	if a.listener == nil {
		l, err := devices.NewListener()
		if err != nil {
			return nil, fmt.Errorf("open uevent listener: %w", err)
		}
		a.listener, a.ownListener = l, true
	}
	// Devices are read from the trees the listener reads them from.
	roots := a.listener.Roots()
	a.lookup = roots.Lookup
	a.crypt = realCrypt{roots: roots}
	if a.implied, err = impliedTransports(cfg.Transports, cfg.Disabled); err != nil {
		return nil, err
	}
	for _, t := range cfg.Transports {
		a.transports[t.Name()] = t
	}
	a.log.Info("state loaded", slog.Int("volumes", st.count()), slog.String("state_dir", cfg.StateDir), slog.Any("transports", a.transportNames()))
	return a, nil
}

func (a *Agent) transportNames() []string {
	names := make([]string, 0, len(a.transports))
	for n := range a.transports {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Close releases what New opened, the state directory's lock last.
// Serve calls it on return.
func (a *Agent) Close() error {
	var err error
	if a.ownListener && a.listener != nil {
		err = a.listener.Close()
		a.listener = nil
	}
	if a.stateLock != nil {
		err = errors.Join(err, a.stateLock.Close())
	}
	return err
}

// lockStateDir creates dir and takes its lock.
func lockStateDir(dir string) (*lockfile.Lock, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create state directory: %w", err)
	}
	l, err := lockfile.Acquire(filepath.Join(dir, "lock"))
	var locked *lockfile.HeldError
	if errors.As(err, &locked) {
		return nil, fmt.Errorf("state directory %s is in use by another berth: %w; stop it, or give each berth its own state directory", dir, err)
	}
	return l, err
}

// Server returns a gRPC server with the Identity and Node services
// registered and the interceptors of the Config installed.
func (a *Agent) Server(opts ...grpc.ServerOption) *grpc.Server {
	ics := append([]grpc.UnaryServerInterceptor{logInterceptor(a.log)}, a.cfg.Interceptors...)
	opts = append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(ics...)}, opts...)
	s := grpc.NewServer(opts...)
	csi.RegisterIdentityServer(s, &identityServer{a: a})
	csi.RegisterNodeServer(s, &nodeServer{a: a})
	return s
}

// Serve answers CSI calls on lis until ctx ends, then stops accepting
// calls and waits for those in flight, for the steps calls left running
// in the kernel (see blocking) and for a trim under way, all within one
// Config.ShutdownTimeout. Meanwhile it registers the paths that join the
// multipath maps of fenced volumes (watchPaths). It calls OnReady once
// calls are accepted and OnStopping when shutdown begins, and closes the
// agent before it returns. lis may come from Listen or from socket
// activation.
func (a *Agent) Serve(ctx context.Context, lis net.Listener) error {
	defer a.Close()
	s := a.Server()
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(lis) }()
	tctx, stopTrim := context.WithCancel(ctx)
	defer stopTrim()
	trimDone := make(chan struct{})
	if a.cfg.TrimInterval > 0 {
		go func() {
			defer close(trimDone)
			a.trimLoop(tctx, a.cfg.TrimInterval)
		}()
	} else {
		close(trimDone)
	}
	pathsDone := make(chan struct{})
	go func() {
		defer close(pathsDone)
		a.watchPaths(tctx, newPathRecheck)
	}()
	a.ready.Store(true)
	a.log.Info("serving", slog.String("endpoint", lis.Addr().String()), slog.String("driver", a.cfg.DriverName), slog.String("node_id", a.cfg.NodeID), slog.String("version", a.cfg.Version))
	if a.cfg.OnReady != nil {
		a.cfg.OnReady()
	}
	var serveErr error
	select {
	case err := <-errc:
		serveErr = fmt.Errorf("serve gRPC: %w", err)
	case <-ctx.Done():
	}
	a.ready.Store(false)
	if serveErr == nil && a.cfg.OnStopping != nil {
		a.cfg.OnStopping()
	}
	sctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
	defer cancel()
	a.log.Info("stopping: waiting for calls in flight", slog.Duration("timeout", a.cfg.ShutdownTimeout))
	stopGRPC(sctx, a.log, s)
	if serveErr == nil {
		if err := <-errc; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			serveErr = fmt.Errorf("serve gRPC: %w", err)
		}
	}
	stopTrim() // a FITRIM under way is not interrupted
	select {
	case <-pathsDone:
	case <-sctx.Done():
	}
	a.finish(sctx, trimDone)
	if serveErr != nil {
		return serveErr
	}
	a.log.Info("stopped")
	return nil
}

// VolumeStatus describes a volume this node has staged (or began to stage).
type VolumeStatus struct {
	ID        string
	Transport string
	// Staged is false for a stage that did not complete.
	Staged bool
	// Abnormal and Message are the volume condition NodeGetVolumeStats
	// reports for the volume at any of its publish targets.
	Abnormal bool
	Message  string
	// Targets is the number of paths the volume is published at.
	Targets int
	// Paths counts the volume's storage paths by state ("live": 2,
	// "connecting": 1), for transports that report them.
	Paths map[string]int
	// Unfenced: fencing applies to the volume and it has none: opted
	// out (volume_context fencing "none"), a target without
	// reservations, or staged by a berth that did not fence
	// (volumeRecord.unfencedReason).
	Unfenced bool
}

// Volumes returns the state of every volume in the agent's records, for
// metrics and diagnostics. It reads memory, sysfs and the mount table;
// it does not take the per-volume locks, so it never answers Aborted.
func (a *Agent) Volumes(ctx context.Context) []VolumeStatus {
	recs := a.state.list()
	out := make([]VolumeStatus, 0, len(recs))
	for _, r := range recs {
		t := a.recordedTarget(r)
		c := a.conditionAt(ctx, r, t, slices.Sorted(maps.Keys(r.Publishes)))
		out = append(out, VolumeStatus{
			ID: r.VolumeID, Transport: r.Transport, Staged: r.Staged,
			Abnormal: c.Abnormal, Message: c.Message, Targets: len(r.Publishes),
			Paths: a.pathStates(ctx, r, t), Unfenced: r.unfencedReason() != "",
		})
	}
	return out
}

// recordedTarget parses a record's target from its stored volume_context
// (without secrets); nil when its transport is gone or it does not parse.
func (a *Agent) recordedTarget(r *volumeRecord) Target {
	tr, ok := a.transports[r.Transport]
	if !ok {
		return nil
	}
	t, err := tr.Parse(r.Context, nil)
	if err != nil {
		return nil
	}
	return t
}

// pathStates asks the volume's target for its paths; nil for a target
// without several paths or when it cannot tell.
func (a *Agent) pathStates(ctx context.Context, r *volumeRecord, t Target) map[string]int {
	if !r.Staged || t == nil {
		return nil
	}
	states, err := t.PathStates(ctx)
	if err != nil {
		a.log.DebugContext(ctx, "path states unavailable", slog.String("volume_id", r.VolumeID), slog.String("error", err.Error()))
		return nil
	}
	return states
}

// StagedContexts returns the stored volume_context of every volume this
// node has staged or is staging, of every transport. A transport uses it
// to keep a connection that another volume still needs.
func (a *Agent) StagedContexts(context.Context) ([]map[string]string, error) {
	recs := a.state.list()
	out := make([]map[string]string, 0, len(recs))
	for _, r := range recs {
		out = append(out, maps.Clone(r.Context))
	}
	return out, nil
}
