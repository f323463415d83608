// Command berth is a CSI node plugin for block storage: it serves the CSI
// Identity and Node services on a unix socket.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/doctor"
	"github.com/berth-csi/berth/file"
	"github.com/berth-csi/berth/internal/cliflags"
	"github.com/berth-csi/berth/internal/kubeletreg"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/metrics"
	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/systemd"
)

// version and commit are set at build time:
// -ldflags '-X main.version=... -X main.commit=...'.
var (
	version = "dev"
	commit  = ""
)

const csiSpecModule = "github.com/container-storage-interface/spec"

func main() {
	app := &cli.App{
		Name:    "berth",
		Usage:   "CSI node plugin for block storage (NVMe-oF, iSCSI, image files)",
		Version: version,
		// berth completion's scripts ask the app what may follow.
		EnableBashCompletion: true,
		Commands: []*cli.Command{
			serveCommand(),
			controllerCommand(),
			takeoverCheckCommand(),
			trimCommand(),
			takeoverCommand(),
			doctor.Command(),
			volumesCommand(),
			versionCommand(),
			completionCommand(),
		},
		// Without commands matching, the app's action runs: an argument
		// is a command that does not exist.
		Action: func(c *cli.Context) error {
			if c.NArg() == 0 {
				return cli.ShowAppHelp(c)
			}
			cli.HelpPrinter(c.App.ErrWriter, cli.AppHelpTemplate, c.App)
			return fmt.Errorf("unknown command %q (see the commands above)", c.Args().First())
		},
	}
	if err := app.Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "berth:", err)
		os.Exit(1)
	}
}

// buildInfo describes this build: version, commit, the Go release that
// built it and the version of the CSI spec it serves.
type buildInfo struct {
	Version string `json:"version"`
	Commit  string `json:"commit"`
	Go      string `json:"go"`
	CSISpec string `json:"csiSpec"`
}

func currentBuild() buildInfo {
	rev, csiSpec := commit, "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == csiSpecModule {
				if d.Replace != nil {
					d = d.Replace
				}
				csiSpec = d.Version
			}
		}
		if rev == "" {
			dirty := ""
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					rev = s.Value
				case "vcs.modified":
					if s.Value == "true" {
						dirty = "-dirty"
					}
				}
			}
			if rev != "" {
				rev += dirty
			}
		}
	}
	if rev == "" {
		rev = "unknown"
	}
	return buildInfo{Version: version, Commit: rev, Go: runtime.Version(), CSISpec: csiSpec}
}

// versionText is berth version's output.
func versionText() string {
	b := currentBuild()
	return fmt.Sprintf("version:  %s\ncommit:   %s\ngo:       %s\ncsi spec: %s\n", b.Version, b.Commit, b.Go, b.CSISpec)
}

func versionCommand() *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print the version, commit, Go version and CSI spec version",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print one JSON object (version, commit, go, csiSpec)"}},
		Action: func(c *cli.Context) error {
			if c.Bool("json") {
				return json.NewEncoder(c.App.Writer).Encode(currentBuild())
			}
			fmt.Fprint(c.App.Writer, versionText())
			return nil
		},
	}
}

func serveCommand() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "serve the CSI Identity and Node services",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "endpoint", Value: doctor.DefaultEndpoint, EnvVars: []string{"BERTH_ENDPOINT", "CSI_ENDPOINT"}, Usage: "CSI endpoint (unix socket); the default is where the kubelet looks for the driver berth.csi.io"},
			&cli.StringFlag{Name: "node-id", Value: defaultNodeID(), EnvVars: []string{"BERTH_NODE_ID"}, Usage: "node ID reported to the CO: must be the kubelet's node name (default: the host name in lower case, as the kubelet names its node without --hostname-override)"},
			&cli.StringFlag{Name: "driver-name", Value: agent.DefaultDriverName, EnvVars: []string{"BERTH_DRIVER_NAME"}, Usage: "CSI driver name"},
			cliflags.StateDirFlag(),
			cliflags.TransportsFlag(),
			cliflags.FileRootFlag(),
			&cli.Int64Flag{Name: "max-volumes", EnvVars: []string{"BERTH_MAX_VOLUMES"}, Usage: "volumes this node may stage (0: no limit)"},
			&cli.StringSliceFlag{Name: "topology", EnvVars: []string{"BERTH_TOPOLOGY"}, Usage: "topology segment key=value (repeatable)"},
			&cli.StringFlag{Name: "log-format", Value: "json", EnvVars: []string{"BERTH_LOG_FORMAT"}, Usage: "log format: json (journal fields under systemd) or text"},
			&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"BERTH_LOG_LEVEL"}, Usage: "log level: debug, info, warn, error"},
			&cli.StringFlag{Name: "metrics-address", EnvVars: []string{"BERTH_METRICS_ADDRESS"}, Usage: "serve Prometheus /metrics on host:port (empty: off)"},
			&cli.StringFlag{Name: "probe-checks", EnvVars: []string{"BERTH_PROBE_CHECKS"}, Usage: "transports whose node checks (berth doctor) Probe runs: comma-separated iscsi, nvmeof, file (empty: none)"},
			cliflags.IscsiadmFlag(),
			cliflags.MultipathdFlag(),
			&cli.BoolFlag{Name: "kubelet-registration", EnvVars: []string{"BERTH_KUBELET_REGISTRATION"}, Usage: "register with the kubelet (plugin registration socket <kubelet-dir>/plugins_registry/<driver-name>-reg.sock), as node-driver-registrar would: for installs without that sidecar"},
			cliflags.KubeletDirFlag("kubelet root directory (its --root-dir), under which --kubelet-registration registers"),
			&cli.StringFlag{Name: "iscsi-node-dir", EnvVars: []string{"BERTH_ISCSI_NODE_DIR"}, Usage: "open-iscsi's node record directory, where its iscsiadm keeps records (empty: /etc/iscsi/nodes or else /var/lib/iscsi/nodes, the first that exists)"},
			&cli.IntFlag{Name: "iscsi-replacement-timeout", Value: -1, EnvVars: []string{"BERTH_ISCSI_REPLACEMENT_TIMEOUT"}, Usage: "node.session.timeo.replacement_timeout for new iSCSI sessions, seconds (-1: open-iscsi's default)"},
			&cli.IntFlag{Name: "iscsi-login-timeout", Value: iscsi.DefaultLoginTimeout, EnvVars: []string{"BERTH_ISCSI_LOGIN_TIMEOUT"}, Usage: "node.conn[0].timeo.login_timeout for new iSCSI sessions, seconds (-1: iscsid.conf's)"},
			&cli.IntFlag{Name: "iscsi-login-retry-max", Value: iscsi.DefaultLoginRetryMax, EnvVars: []string{"BERTH_ISCSI_LOGIN_RETRY_MAX"}, Usage: "node.session.initial_login_retry_max for new iSCSI sessions (-1: iscsid.conf's); a silent portal costs a stage (1 + this) * --iscsi-login-timeout"},
			&cli.DurationFlag{Name: "shutdown-timeout", Value: 30 * time.Second, EnvVars: []string{"BERTH_SHUTDOWN_TIMEOUT"}, Usage: "how long berth waits on SIGTERM for the calls in flight and the steps they left running in the kernel before it exits (keep systemd's TimeoutStopSec and the pod's terminationGracePeriodSeconds longer)"},
			&cli.DurationFlag{Name: "trim-interval", EnvVars: []string{"BERTH_TRIM_INTERVAL"}, Usage: "trim the filesystem of every staged mount volume once per interval, each at its own offset into it (such as 24h; 0: never; see berth trim)"},
			takeoverFlag(),
		},
		Action: serve,
	}
}

// defaultNodeID is the name the kubelet gives its node when it runs
// without --hostname-override: the host name in lower case.
func defaultNodeID() string {
	host, _ := os.Hostname()
	return strings.ToLower(host)
}

func newLogger(format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		// Durations in seconds, as in the JSON logs.
		opts.ReplaceAttr = systemd.DurationSeconds
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(systemd.NewLogHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

func parseTopology(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--topology %q: want key=value", kv)
		}
		if old, dup := out[k]; dup && old != v {
			return nil, fmt.Errorf("--topology %q: key given twice", k)
		}
		out[k] = v
	}
	return out, nil
}

// probeConfig is the doctor configuration of --probe-checks: the
// programs serve runs, no endpoint or kubelet directory checks.
func probeConfig(c *cli.Context) (doctor.Config, error) {
	transports, err := doctor.ParseTransports(c.String("probe-checks"))
	if err != nil {
		return doctor.Config{}, fmt.Errorf("--probe-checks: %w", err)
	}
	return doctor.Config{Transports: transports, Iscsiadm: c.String(cliflags.Iscsiadm), Multipathd: c.String(cliflags.Multipathd)}, nil
}

func serve(c *cli.Context) error {
	// berth mounts, formats and attaches devices: as another user it would
	// start, answer Probe, and fail every volume.
	if euid := os.Geteuid(); euid != 0 {
		return fmt.Errorf("berth serve must run as root (it mounts filesystems, formats and attaches block devices); running as uid %d", euid)
	}
	ctx, stop := systemd.StopOnSignal(c.Context)
	defer stop()
	s, err := newServer(c)
	if err != nil {
		return err
	}
	return s.run(ctx)
}

// server is what berth serve runs: the agent, its CSI socket, and the
// metrics, kubelet registration and watchdog beside it.
type server struct {
	log        *slog.Logger
	agent      *agent.Agent
	uevents    *devices.Listener
	csi        net.Listener
	socket     string
	activated  bool
	metrics    *metrics.Metrics
	metricsLis net.Listener
	reg        *kubeletreg.Registrar
	checks     doctor.Config
}

// newServer builds everything berth serve runs from its flags, in the
// order that keeps a half-started berth invisible: the state directory is
// locked before any socket is bound, and the kubelet's registration socket
// comes last. When a step fails, what the earlier ones opened is closed by
// one deferred undo.
func newServer(c *cli.Context) (_ *server, retErr error) {
	var undo []func()
	defer func() {
		if retErr != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()
	log, err := newLogger(c.String("log-format"), c.String("log-level"))
	if err != nil {
		return nil, err
	}
	slog.SetDefault(log)
	s := &server{log: log}
	topo, err := parseTopology(c.StringSlice("topology"))
	if err != nil {
		return nil, err
	}
	if s.socket, err = agent.SocketPath(c.String("endpoint")); err != nil {
		return nil, err
	}
	metricsAddr := c.String("metrics-address")
	if metricsAddr != "" {
		if err := metrics.CheckAddress(metricsAddr); err != nil {
			return nil, fmt.Errorf("--metrics-address %q: %w", metricsAddr, err)
		}
	}
	nodeID := c.String("node-id")
	if nodeID == "" {
		return nil, fmt.Errorf("--node-id is empty: give the kubelet's node name (the host name, in lower case, unless the kubelet runs with --hostname-override)")
	}
	if c.Bool("kubelet-registration") {
		checkKubeletNodeName(log, c.String(cliflags.KubeletDir), nodeID)
	}

	cfg := agent.Config{
		DriverName:      c.String("driver-name"),
		Version:         version,
		NodeID:          nodeID,
		StateDir:        c.String(cliflags.StateDir),
		MaxVolumes:      c.Int64("max-volumes"),
		Topology:        topo,
		Logger:          log,
		ShutdownTimeout: c.Duration("shutdown-timeout"),
		TrimInterval:    c.Duration("trim-interval"),
		OnReady: func() {
			if err := systemd.Ready(); err != nil {
				log.Warn("notify systemd", slog.String("error", err.Error()))
			}
		},
		OnStopping: func() { _ = systemd.Stopping() },
		Takeover:   []agent.TakeoverAuthority{agent.NewOperatorAuthority(c.String(cliflags.StateDir))},
	}
	if c.Bool(takeoverFromKubernetes) {
		t, err := newKubeTakeover(cfg.DriverName, nodeID)
		if err != nil {
			return nil, fmt.Errorf("--%s: %w", takeoverFromKubernetes, err)
		}
		cfg.Takeover = append(cfg.Takeover, t)
		cfg.HolderName = t.k.NodeOfKey
	}
	if c.String("probe-checks") != "" {
		dc, err := probeConfig(c)
		if err != nil {
			return nil, err
		}
		cfg.ReadyFunc = doctor.ReadyFunc(dc)
	}
	if metricsAddr != "" {
		// Metrics read the agent's volume table, which exists once New ran.
		s.metrics = metrics.New(cfg.DriverName, func(ctx context.Context) []metrics.Volume {
			if s.agent == nil {
				return nil
			}
			vs := s.agent.Volumes(ctx)
			out := make([]metrics.Volume, 0, len(vs))
			for _, v := range vs {
				if v.Staged {
					out = append(out, metrics.Volume{ID: v.ID, Transport: v.Transport, Paths: v.Paths, Abnormal: v.Abnormal, Unfenced: v.Unfenced})
				}
			}
			return out
		})
		cfg.Interceptors = append(cfg.Interceptors, s.metrics.UnaryServerInterceptor())
		cfg.OnTrim = func(r agent.TrimResult) { s.metrics.ObserveTrim(trimMetricResult(r), r.Trimmed) }
	}

	// One uevent listener serves the agent and every transport.
	if s.uevents, err = devices.NewListener(devices.WithLogger(log)); err != nil {
		return nil, fmt.Errorf("open uevent listener: %w", err)
	}
	undo = append(undo, func() { s.uevents.Close() })
	cfg.Listener = s.uevents
	ts, disabled, err := buildTransports(transportOptions{
		list:     c.String(cliflags.Transports),
		fileRoot: c.String(cliflags.FileRoot),
		iscsi:    iscsiOptions(c),
		listener: s.uevents,
		log:      log,
		staged: func(ctx context.Context) ([]map[string]string, error) {
			if s.agent == nil {
				return nil, nil
			}
			return s.agent.StagedContexts(ctx)
		},
	})
	if err != nil {
		return nil, err
	}
	if len(ts) == 0 {
		return nil, fmt.Errorf("no transport enabled: --transports is empty and --file-root is not set; berth would have no volume to serve")
	}
	cfg.Transports, cfg.Disabled = ts, disabled
	s.checks = startupChecks(c, ts)

	// New locks the state directory before it reads it: a second berth on
	// it stops here, before it binds anything.
	if s.agent, err = agent.New(cfg); err != nil {
		return nil, err
	}
	undo = append(undo, func() { s.agent.Close() })
	if s.metrics != nil {
		if s.metricsLis, err = metrics.Listen(metricsAddr); err != nil {
			return nil, fmt.Errorf("--metrics-address %q: %w", metricsAddr, err)
		}
		undo = append(undo, func() { s.metricsLis.Close() })
	}
	if s.csi, s.activated, err = csiListener(c.String("endpoint"), s.socket); err != nil {
		return nil, err
	}
	undo = append(undo, func() { s.csi.Close() })
	// The kubelet dials the CSI socket once it has read the registration
	// socket, so that one is created last.
	if c.Bool("kubelet-registration") {
		s.reg, err = kubeletreg.Listen(kubeletreg.Config{
			KubeletDir: c.String(cliflags.KubeletDir),
			DriverName: cfg.DriverName,
			Endpoint:   s.socket,
			Logger:     log,
		})
		if err != nil {
			return nil, err
		}
	}
	return s, nil
}

// iscsiOptions are the iSCSI transport's options from berth serve's flags.
func iscsiOptions(c *cli.Context) iscsi.Options {
	o := iscsi.Options{
		Iscsiadm:   c.String(cliflags.Iscsiadm),
		Multipathd: c.String(cliflags.Multipathd),
		NodeDir:    c.String("iscsi-node-dir"),
		Params:     map[string]int{},
	}
	for flag, param := range map[string]string{
		"iscsi-replacement-timeout": iscsi.ParamReplacementTimeout,
		"iscsi-login-timeout":       iscsi.ParamLoginTimeout,
		"iscsi-login-retry-max":     iscsi.ParamLoginRetryMax,
	} {
		if v := c.Int(flag); v >= 0 {
			o.Params[param] = v
		}
	}
	return o
}

// run serves until ctx ends; the agent's Serve closes the agent and the
// CSI socket, and the others stop with the context.
func (s *server) run(ctx context.Context) error {
	defer s.uevents.Close()
	attrs := []any{slog.String("csi_endpoint", s.socket), slog.Bool("socket_activated", s.activated)}
	if s.metricsLis != nil {
		attrs = append(attrs, slog.String("metrics_address", s.metricsLis.Addr().String()))
	}
	s.log.Info("listening", append(attrs, slog.Int("pid", os.Getpid()))...)
	go warnNodeChecks(ctx, s.log, s.checks)

	var wg sync.WaitGroup
	defer wg.Wait()
	bgCtx, cancelBg := context.WithCancel(ctx)
	defer cancelBg()
	background := func(what string, f func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(bgCtx); err != nil {
				s.log.Error(what, slog.String("error", err.Error()))
			}
		}()
	}
	if s.metrics != nil {
		background("metrics server stopped", func(ctx context.Context) error { return s.metrics.Serve(ctx, s.metricsLis) })
	}
	if s.reg != nil {
		background("kubelet registration stopped", s.reg.Serve)
	}
	background("systemd watchdog", func(ctx context.Context) error {
		return systemd.Watchdog(ctx, s.log, systemd.ProbeEndpoint(s.socket))
	})
	return s.agent.Serve(ctx, s.csi)
}

// checkKubeletNodeName warns when the node ID is not the name the
// kubelet registered its node under: the CO then cannot match this
// node's volumes and topology to its Node object. The kubelet's client
// certificate names its node (system:node:NAME); a node without one (a
// kubelet without TLS bootstrap) is not checked.
func checkKubeletNodeName(log *slog.Logger, kubeletDir, nodeID string) {
	name, err := kubeletreg.NodeName(kubeletDir)
	if err != nil {
		log.Debug("the kubelet's node name is not known: --node-id is not checked against it", slog.String("error", err.Error()))
		return
	}
	if name != nodeID {
		log.Warn("--node-id is not the kubelet's node name: give berth serve --node-id="+name,
			slog.String("node_id", nodeID), slog.String("kubelet_node_name", name))
	}
}

// startupChecks is the doctor configuration of the transports this berth
// serves, with the programs it runs.
func startupChecks(c *cli.Context, ts []agent.Transport) doctor.Config {
	var names []string
	for _, t := range ts {
		names = append(names, t.Name())
	}
	return doctor.Config{Transports: names, Iscsiadm: c.String(cliflags.Iscsiadm), Multipathd: c.String(cliflags.Multipathd)}
}

// warnNodeChecks runs berth doctor's checks for the enabled transports
// once at startup and logs a warning for each that does not pass, so that
// a node missing a kernel module or a capability says so before the first
// volume fails on it. It does not stop berth: a module may be loaded
// later, and other transports may still serve.
func warnNodeChecks(ctx context.Context, log *slog.Logger, cfg doctor.Config) {
	r := doctor.Run(ctx, cfg)
	for _, ch := range r.Checks {
		if ch.Status == doctor.OK {
			continue
		}
		attrs := []any{slog.String("check", ch.Name), slog.String("status", string(ch.Status)), slog.String("detail", ch.Detail)}
		if ch.Fix != "" {
			attrs = append(attrs, slog.String("fix", ch.Fix))
		}
		log.Warn("node check did not pass (berth doctor tells more)", attrs...)
	}
}

// csiListener returns the socket systemd passed (socket activation) or
// else creates the endpoint's socket. Either way it holds the endpoint's
// lock, so a second berth on the endpoint is refused and names this one.
func csiListener(endpoint, socket string) (lis net.Listener, activated bool, err error) {
	lis, err = systemd.Listener(socket)
	if err != nil {
		return nil, false, err
	}
	if lis == nil {
		lis, err = agent.Listen(endpoint)
		return lis, false, err
	}
	locked, err := agent.LockListener(lis, socket)
	if err != nil {
		lis.Close()
		return nil, false, err
	}
	return locked, true, nil
}

// transportPlugin is a transport berth knows: its kind (name and the
// volume_context keys that select it) and how berth serve builds it.
type transportPlugin struct {
	kind agent.TransportKind
	// flag is the flag that enables the transport (without the dashes),
	// or "" for one that --transports lists: a network transport.
	flag string
	// build makes the transport from the flags. It runs for a listed
	// transport that --transports names, and for every other one, which
	// returns nil when its flag leaves it disabled.
	build func(kind agent.TransportKind, o transportOptions) (agent.Transport, error)
}

// transportPlugins is every transport berth knows. A new transport is
// its package and a line here.
var transportPlugins = []transportPlugin{
	{kind: agent.TransportKind{Name: file.Name, Keys: file.TransportKeys()}, flag: "file-root", build: newFileTransport},
	{kind: agent.TransportKind{Name: nvmeof.Name, Keys: nvmeof.TransportKeys()}, build: newNVMeoFTransport},
	{kind: agent.TransportKind{Name: iscsi.Name, Keys: iscsi.TransportKeys()}, build: newISCSITransport},
}

// transportOptions is what the transports are built from: berth serve's
// flags, the uevent listener they share, and the volumes staged.
type transportOptions struct {
	list     string // --transports
	fileRoot string // --file-root
	iscsi    iscsi.Options
	listener *devices.Listener
	log      *slog.Logger
	staged   func(context.Context) ([]map[string]string, error)
}

// set reports whether the flag that enables a transport is given.
func (o transportOptions) set(flag string) bool {
	return flag == "file-root" && o.fileRoot != ""
}

func newFileTransport(kind agent.TransportKind, o transportOptions) (agent.Transport, error) {
	if o.fileRoot == "" {
		return nil, nil
	}
	t, err := file.New(o.fileRoot, o.listener)
	if err != nil {
		return nil, err
	}
	return agent.TransportFunc(kind, t.Parse), nil
}

func newNVMeoFTransport(kind agent.TransportKind, o transportOptions) (agent.Transport, error) {
	t, err := nvmeof.NewTransport(nvmeof.Options{Listener: o.listener, Staged: o.staged, Logger: o.log})
	if err != nil {
		return nil, fmt.Errorf("nvmeof transport: %w", err)
	}
	return agent.TransportFunc(kind, t.Parse), nil
}

func newISCSITransport(kind agent.TransportKind, o transportOptions) (agent.Transport, error) {
	opts := o.iscsi
	opts.Listener, opts.Logger = o.listener, o.log
	t, err := iscsi.New(opts)
	if err != nil {
		return nil, fmt.Errorf("iscsi transport: %w", err)
	}
	return agent.TransportFunc(kind, t.Parse), nil
}

// buildTransports builds the transports the flags enable (o.list, a
// comma-separated list of transport names, and each transport's own flag,
// which enables it whether listed or not) and returns the kinds of the
// others. A listed transport whose flag is not given is an error.
func buildTransports(o transportOptions) (enabled []agent.Transport, disabled []agent.TransportKind, err error) {
	listed := map[string]bool{}
	var want []string
	for _, p := range transportPlugins {
		want = append(want, p.kind.Name)
	}
	for _, name := range strings.Split(o.list, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		i := slices.IndexFunc(transportPlugins, func(p transportPlugin) bool { return p.kind.Name == name })
		switch {
		case i < 0:
			return nil, nil, fmt.Errorf("--transports: unknown transport %q (want %s)", name, strings.Join(want, ", "))
		case transportPlugins[i].flag != "" && !o.set(transportPlugins[i].flag):
			return nil, nil, fmt.Errorf("--transports lists %s, which needs --%s", name, transportPlugins[i].flag)
		}
		listed[name] = true
	}
	for _, p := range transportPlugins {
		var t agent.Transport
		if p.flag != "" || listed[p.kind.Name] {
			if t, err = p.build(p.kind, o); err != nil {
				return nil, nil, err
			}
		}
		if t == nil {
			disabled = append(disabled, p.kind)
			continue
		}
		enabled = append(enabled, t)
	}
	return enabled, disabled, nil
}
