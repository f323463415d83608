package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/urfave/cli/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/internal/testutil"
)

func TestParseTopology(t *testing.T) {
	got, err := parseTopology([]string{"topology.berth.csi.io/zone=a", "rack=r1"})
	if err != nil || len(got) != 2 || got["topology.berth.csi.io/zone"] != "a" || got["rack"] != "r1" {
		t.Fatalf("parseTopology: %v, %v", got, err)
	}
	for _, bad := range [][]string{{"novalue"}, {"=x"}, {"k=a", "k=b"}} {
		if _, err := parseTopology(bad); err == nil {
			t.Errorf("parseTopology(%q) accepted", bad)
		}
	}
	if got, err := parseTopology(nil); err != nil || got != nil {
		t.Fatalf("no topology: %v, %v", got, err)
	}
}

func TestNewLogger(t *testing.T) {
	for _, f := range []string{"text", "json"} {
		if _, err := newLogger(f, "debug"); err != nil {
			t.Errorf("newLogger(%q): %v", f, err)
		}
	}
	if _, err := newLogger("xml", "info"); err == nil {
		t.Error("log format xml accepted")
	}
	if _, err := newLogger("text", "loud"); err == nil {
		t.Error("log level loud accepted")
	}
}

func TestBuildTransports(t *testing.T) {
	names := func(ts []agent.Transport) (out []string) {
		for _, t := range ts {
			out = append(out, t.Name())
		}
		return out
	}
	kinds := func(ks []agent.TransportKind) (out []string) {
		for _, k := range ks {
			out = append(out, k.Name)
		}
		return out
	}
	// iscsi needs a uevent listener (root); nvmeof opens nothing yet.
	ts, off, err := buildTransports(transportOptions{list: "nvmeof, ,nvmeof"})
	if err != nil || !slices.Equal(names(ts), []string{"nvmeof"}) || !slices.Equal(kinds(off), []string{"file", "iscsi"}) {
		t.Fatalf("buildTransports: %v, %v, %v", names(ts), kinds(off), err)
	}
	if ts, off, err := buildTransports(transportOptions{}); err != nil || len(ts) != 0 || len(off) != len(transportPlugins) {
		t.Fatalf("no transports: %v, %v, %v", names(ts), kinds(off), err)
	}
	root := t.TempDir()
	ts, off, err = buildTransports(transportOptions{list: "nvmeof", fileRoot: root})
	if err != nil || !slices.Equal(names(ts), []string{"file", "nvmeof"}) || !slices.Equal(kinds(off), []string{"iscsi"}) {
		t.Fatalf("file root and nvmeof: %v, %v, %v", names(ts), kinds(off), err)
	}
	if !slices.Equal(ts[0].Keys(), []string{"file"}) {
		t.Errorf("file transport's keys %q, want [file]", ts[0].Keys())
	}
	ts, _, err = buildTransports(transportOptions{list: "file,nvmeof", fileRoot: root})
	if err != nil || !slices.Equal(names(ts), []string{"file", "nvmeof"}) {
		t.Fatalf("file listed with a file root: %v, %v", names(ts), err)
	}
	if _, _, err := buildTransports(transportOptions{fileRoot: "relative"}); err == nil {
		t.Error("a relative --file-root accepted")
	}
	for bad, want := range map[string]string{
		"file": "--transports lists file, which needs --file-root",
		"fc":   `unknown transport "fc" (want file, nvmeof, iscsi)`,
	} {
		if _, _, err := buildTransports(transportOptions{list: bad}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("buildTransports(%q) = %v, want an error containing %q", bad, err, want)
		}
	}
}

// Every transport berth knows has a name of its own, the name its
// package's transport answers, and keys no other transport claims; the
// keys select it as before.
func TestTransportPlugins(t *testing.T) {
	owner := map[string]string{}
	seen := map[string]bool{}
	for _, p := range transportPlugins {
		if p.kind.Name == "" || seen[p.kind.Name] {
			t.Errorf("transport name %q empty or twice", p.kind.Name)
		}
		seen[p.kind.Name] = true
		for _, k := range p.kind.Keys {
			if o, ok := owner[k]; ok {
				t.Errorf("volume_context key %q selects %s and %s", k, o, p.kind.Name)
			}
			owner[k] = p.kind.Name
		}
	}
	want := map[string]string{"file": "file", "iqn": "iscsi", "targetPortal": "iscsi", "nqn": "nvmeof", "targetTrAddr": "nvmeof"}
	if !maps.Equal(owner, want) {
		t.Errorf("keys select %v, want %v", owner, want)
	}
}

// The tests below run the berth binary: $BERTH_BIN, or one built from this
// package once per test run.
var (
	buildOnce sync.Once
	buildDir  string
	builtBin  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

func berthBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("BERTH_BIN"); p != "" {
		return p
	}
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "berth-main-test-")
		if buildErr != nil {
			return
		}
		builtBin = filepath.Join(buildDir, "berth")
		cmd := exec.Command("go", "build", "-o", builtBin, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("build berth: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtBin
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// berthProc is a running `berth serve`.
type berthProc struct {
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan struct{} // closed when the process exited; then err is set
	err  error
}

// berthArgs are the flags of a berth that starts fast on this host: no
// iSCSI, text logs.
func berthArgs(sock, state, node string, extra ...string) []string {
	return append([]string{"serve", "--endpoint=unix://" + sock, "--state-dir=" + state,
		"--node-id=" + node, "--transports=nvmeof", "--log-format=text"}, extra...)
}

func startBerth(t *testing.T, cmd *exec.Cmd) *berthProc {
	t.Helper()
	p := &berthProc{cmd: cmd, out: &lockedBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

func serveBerth(t *testing.T, args ...string) *berthProc {
	t.Helper()
	return startBerth(t, exec.Command(berthBinary(t), args...))
}

func (p *berthProc) exited(within time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(within):
		return false
	}
}

func (p *berthProc) pid() string { return strconv.Itoa(p.cmd.Process.Pid) }

// stop ends p with SIGTERM and checks that it exits cleanly.
func (p *berthProc) stop(t *testing.T) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	if !p.exited(30 * time.Second) {
		t.Fatalf("berth %s did not stop on SIGTERM:\n%s", p.pid(), p.out)
	}
	if p.err != nil {
		t.Errorf("berth %s stopped with %v:\n%s", p.pid(), p.err, p.out)
	}
}

// mustFail waits for p to exit non-zero and returns its output.
func (p *berthProc) mustFail(t *testing.T, what string) string {
	t.Helper()
	if !p.exited(15 * time.Second) {
		t.Fatalf("%s: berth still serving after 15s:\n%s", what, p.out)
	}
	if p.err == nil {
		t.Fatalf("%s: berth exited 0:\n%s", what, p.out)
	}
	return p.out.String()
}

// nodeID asks the server on sock for its node ID.
func nodeID(t *testing.T, sock string, wait time.Duration) (string, error) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	r, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}, grpc.WaitForReady(true))
	return r.GetNodeId(), err
}

func mustServe(t *testing.T, p *berthProc, sock, node string) {
	t.Helper()
	got, err := nodeID(t, sock, 20*time.Second)
	if err != nil || got != node {
		t.Fatalf("berth %s on %s: NodeGetInfo = %q, %v\n%s", p.pid(), sock, got, err, p.out)
	}
}

// A second berth on the same state directory would stage the same
// volumes as the first (two mkfs on one device); it must refuse to start
// and say which process holds the directory.
func TestServeOneAgentPerStateDir(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	first := serveBerth(t, berthArgs(filepath.Join(dir, "a.sock"), state, "a")...)
	mustServe(t, first, filepath.Join(dir, "a.sock"), "a")

	second := serveBerth(t, berthArgs(filepath.Join(dir, "b.sock"), state, "b")...)
	out := second.mustFail(t, "second berth on one state directory")
	if !strings.Contains(out, "pid "+first.pid()) || !strings.Contains(out, state) {
		t.Errorf("the refusal names neither the state directory nor pid %s:\n%s", first.pid(), out)
	}
	if _, err := os.Stat(filepath.Join(dir, "b.sock")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("refused berth left its socket: %v", err)
	}
	mustServe(t, first, filepath.Join(dir, "a.sock"), "a")
	first.stop(t)

	// Once the holder is gone the directory is free again.
	third := serveBerth(t, berthArgs(filepath.Join(dir, "c.sock"), state, "c")...)
	mustServe(t, third, filepath.Join(dir, "c.sock"), "c")
	third.stop(t)
}

// Two berths started at the same moment on one socket (different state
// directories): exactly one serves, on a socket file that is still there
// after the other exited.
func TestServeOneAgentPerSocket(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	bin := berthBinary(t)
	const rounds = 20
	var bothAlive, lostSocket, noPid int
	for i := range rounds {
		dir := t.TempDir()
		sock := filepath.Join(dir, "csi.sock")
		a := startBerth(t, exec.Command(bin, berthArgs(sock, filepath.Join(dir, "a"), "a")...))
		b := startBerth(t, exec.Command(bin, berthArgs(sock, filepath.Join(dir, "b"), "b")...))
		var loser, winner *berthProc
		var name string
		select {
		case <-a.done:
			loser, winner, name = a, b, "b"
		case <-b.done:
			loser, winner, name = b, a, "a"
		case <-time.After(5 * time.Second):
		}
		if loser == nil {
			bothAlive++
			// Which one does the socket reach? Stopping the other must
			// leave the socket in place.
			got, err := nodeID(t, sock, 5*time.Second)
			if err != nil {
				t.Errorf("round %d: both berths alive, socket answers neither: %v", i, err)
				continue
			}
			t.Logf("round %d: both berths alive; the socket reaches %s", i, got)
			other := a
			if got == "a" {
				other = b
			}
			other.stop(t)
			if _, err := nodeID(t, sock, 2*time.Second); err != nil {
				lostSocket++
				t.Errorf("round %d: the berth the socket did not reach removed the other's socket on exit: %v", i, err)
			}
			a.stop(t)
			b.stop(t)
			continue
		}
		if loser.err == nil {
			t.Errorf("round %d: the refused berth exited 0:\n%s", i, loser.out)
		}
		got, err := nodeID(t, sock, 10*time.Second)
		if err != nil || got != name {
			lostSocket++
			t.Errorf("round %d: after the other exited, the socket gives %q, %v; want the survivor %s\nsurvivor:\n%s\nrefused:\n%s", i, got, err, name, winner.out, loser.out)
		}
		if !strings.Contains(loser.out.String(), "pid "+winner.pid()) {
			noPid++
			if noPid == 1 {
				t.Errorf("round %d: the refusal does not name the holder's pid %s:\n%s", i, winner.pid(), loser.out)
			}
		}
		winner.stop(t)
		if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("round %d: socket left after the survivor stopped: %v", i, err)
		}
	}
	t.Logf("%d rounds: both alive %d, socket lost or wrong %d, refusal without pid %d", rounds, bothAlive, lostSocket, noPid)
	if bothAlive > 0 || lostSocket > 0 || noPid > 0 {
		t.Errorf("%d of %d rounds had two berths alive, %d lost the survivor's socket, %d refusals did not name the holder", bothAlive, rounds, lostSocket, noPid)
	}
}

// Under socket activation the socket comes from systemd, but the state
// directory is still locked, a second berth on the activated endpoint is
// refused, and closing the activated listener leaves systemd's socket.
func TestServeSocketActivatedLocks(t *testing.T) {
	testutil.RequireRoot(t, "berth serve", "systemd-socket-activate")
	tool, err := exec.LookPath("systemd-socket-activate")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock, state := filepath.Join(dir, "csi.sock"), filepath.Join(dir, "state")
	args := append([]string{"-l", sock, berthBinary(t)}, berthArgs(sock, state, "act")...)
	act := startBerth(t, exec.Command(tool, args...))
	deadline := time.Now().Add(10 * time.Second)
	for _, err := os.Stat(sock); err != nil; _, err = os.Stat(sock) {
		if time.Now().After(deadline) {
			t.Fatalf("no activation socket: %v\n%s", err, act.out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	mustServe(t, act, sock, "act") // systemd-socket-activate execs berth: same pid
	if !regexp.MustCompile(`msg=listening csi_endpoint=` + regexp.QuoteMeta(sock) + ` socket_activated=true`).MatchString(act.out.String()) {
		t.Errorf("startup log does not say the socket came from systemd:\n%s", act.out)
	}

	sameState := serveBerth(t, berthArgs(filepath.Join(dir, "other.sock"), state, "x")...)
	if out := sameState.mustFail(t, "berth on the activated berth's state directory"); !strings.Contains(out, "pid "+act.pid()) {
		t.Errorf("the refusal does not name pid %s:\n%s", act.pid(), out)
	}
	sameSocket := serveBerth(t, berthArgs(sock, filepath.Join(dir, "state2"), "y")...)
	if out := sameSocket.mustFail(t, "berth on the activated endpoint"); !strings.Contains(out, "pid "+act.pid()) {
		t.Errorf("the refusal does not name pid %s:\n%s", act.pid(), out)
	}
	mustServe(t, act, sock, "act")
	act.stop(t)
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("activation socket after berth exited: %v %v", fi, err)
	}
}

// A --metrics-address berth cannot serve stops it from starting: the
// operator asked for metrics and would otherwise find none.
func TestServeRefusesBadMetricsAddress(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for _, tc := range []struct{ name, addr, want string }{
		{"no port", "9810", `--metrics-address "9810"`},
		{"bad port", "127.0.0.1:http", `--metrics-address "127.0.0.1:http"`},
		{"busy", busy.Addr().String(), "address already in use"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			sock := filepath.Join(dir, "csi.sock")
			p := serveBerth(t, berthArgs(sock, filepath.Join(dir, "state"), "m", "--metrics-address="+tc.addr)...)
			if out := p.mustFail(t, "--metrics-address="+tc.addr); !strings.Contains(out, tc.want) {
				t.Errorf("the refusal lacks %q:\n%s", tc.want, out)
			}
			if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("refused berth left a socket: %v", err)
			}
		})
	}
}

// A berth with no transport cannot stage anything; it must not start and
// answer Probe as if it could.
func TestServeRefusesNoTransports(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	p := serveBerth(t, "serve", "--endpoint=unix://"+filepath.Join(dir, "csi.sock"), "--state-dir="+filepath.Join(dir, "state"),
		"--node-id=n", "--transports=", "--log-format=text")
	if out := p.mustFail(t, "no transports"); !strings.Contains(out, "no transport enabled") {
		t.Errorf("the refusal does not say that no transport is enabled:\n%s", out)
	}
}

// berth serve selects a volume's transport by the keys each transport
// declares, and refuses one it knows but does not serve by name: on a
// node serving file and nvmeof, iSCSI keys are "not enabled", not "no
// transport".
func TestServeSelectsTransportByKeys(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	sock, images, staging := filepath.Join(dir, "csi.sock"), filepath.Join(dir, "images"), filepath.Join(dir, "staging")
	for _, d := range []string{images, staging} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	p := serveBerth(t, berthArgs(sock, filepath.Join(dir, "state"), "k", "--file-root="+images)...)
	mustServe(t, p, sock, "k")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	for _, tc := range []struct {
		vc   map[string]string
		want string
	}{
		{map[string]string{"iqn": "iqn.2003-01.org.example:t", "targetPortal": "127.0.0.1:3260", "lun": "0"}, `transport "iscsi" is not enabled on this node (enabled: [file nvmeof])`},
		{map[string]string{"lun": "0"}, `volume_context: names no transport`},
		{map[string]string{"file": "a.img", "nqn": "nqn.2014-08.org.example:t"}, `keys of several transports [file nvmeof]`},
		{map[string]string{"file": "../a.img"}, `volume_context["file"] "../a.img": contains ".."`},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
			VolumeId: "v", StagingTargetPath: staging, VolumeContext: tc.vc,
			VolumeCapability: &csi.VolumeCapability{
				AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			},
		})
		cancel()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("stage with %v: %v; want InvalidArgument with %q", tc.vc, err, tc.want)
		}
	}
	p.stop(t)
}

// berth mounts, formats and attaches devices; run as another user it
// would fail on the first volume instead of at start.
func TestServeRefusesNonRoot(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	// A directory the unprivileged user may enter, write and run berth from.
	dir, err := os.MkdirTemp("", "berth-nonroot-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	const nobody = 65534
	bin := filepath.Join(dir, "berth")
	src, err := os.ReadFile(berthBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, src, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, berthArgs(filepath.Join(dir, "csi.sock"), filepath.Join(dir, "state"), "n")...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	p := startBerth(t, cmd)
	if out := p.mustFail(t, "berth as uid 65534"); !strings.Contains(out, "must run as root") {
		t.Errorf("the refusal does not say berth must run as root:\n%s", out)
	}
	if _, err := os.Stat(filepath.Join(dir, "state")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("refused berth created its state directory: %v", err)
	}
}

// The startup log gives every address berth listens on, the metrics one
// as bound (port 0 picks a free port).
func TestServeLogsListeningAddresses(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	p := serveBerth(t, berthArgs(sock, filepath.Join(dir, "state"), "l", "--metrics-address=127.0.0.1:0")...)
	mustServe(t, p, sock, "l")
	re := regexp.MustCompile(`msg=listening csi_endpoint=` + regexp.QuoteMeta(sock) + ` socket_activated=false metrics_address=(127\.0\.0\.1:[1-9][0-9]*) pid=` + p.pid() + `\n`)
	m := re.FindStringSubmatch(p.out.String())
	if m == nil {
		t.Fatalf("no startup line matching %s:\n%s", re, p.out)
	}
	resp, err := http.Get("http://" + m[1] + "/metrics")
	if err != nil {
		t.Fatalf("scrape the logged metrics address: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "csi_plugin_operations_seconds") {
		t.Errorf("the logged metrics address serves no berth metrics:\n%s", body)
	}
	p.stop(t)
}

// serve warns at startup about each node check that does not pass for
// an enabled transport: this host has no iscsi_tcp module.
func TestServeWarnsAboutNodeChecks(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	if _, err := os.Stat("/sys/class/iscsi_transport/tcp"); err == nil {
		t.Skip("this host has iscsi_tcp loaded; the check passes")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	p := serveBerth(t, berthArgs(sock, filepath.Join(dir, "state"), "w", "--transports=iscsi")...)
	mustServe(t, p, sock, "w")
	deadline := time.Now().Add(10 * time.Second)
	re := regexp.MustCompile(`level=WARN msg="node check did not pass[^"]*" check="?module iscsi_tcp"? status=fail`)
	for !re.MatchString(p.out.String()) {
		if time.Now().After(deadline) {
			t.Fatalf("no startup warning matching %s:\n%s", re, p.out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	p.stop(t)
}

// csiModuleVersion is the CSI spec module version go.mod requires.
func csiModuleVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*github\.com/container-storage-interface/spec (v\S+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("go.mod does not require the CSI spec module")
	}
	return string(m[1])
}

func TestVersionCommand(t *testing.T) {
	out, err := exec.Command(berthBinary(t), "version").CombinedOutput()
	if err != nil {
		t.Fatalf("berth version: %v\n%s", err, out)
	}
	for _, want := range []string{
		"version:  ",
		"commit:   ",
		"go:       " + runtime.Version() + "\n",
		"csi spec: " + csiModuleVersion(t) + "\n",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("berth version lacks %q:\n%s", want, out)
		}
	}
}

func TestVersionJSON(t *testing.T) {
	out, err := exec.Command(berthBinary(t), "version", "--json").Output()
	if err != nil {
		t.Fatalf("berth version --json: %v", err)
	}
	var v struct{ Version, Commit, Go, CSISpec string }
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("berth version --json: %v\n%s", err, out)
	}
	if v.Version == "" || v.Commit == "" || v.Go != runtime.Version() || v.CSISpec != csiModuleVersion(t) {
		t.Errorf("berth version --json = %+v", v)
	}
}

// The bash script completes commands and a command's flags by asking
// the binary, as a shell does on <Tab>.
func TestCompletionBash(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	bin := berthBinary(t)
	for words, want := range map[string]string{
		"se":           "serve",
		"serve --node": "--node-id",
		"version --j":  "--json",
	} {
		script := `source <("$BERTH" completion bash); COMP_WORDS=("$BERTH" ` + words + `); COMP_CWORD=$((${#COMP_WORDS[@]}-1)); _berth; printf '%s\n' "${COMPREPLY[@]}"`
		cmd := exec.Command(bash, "-c", script)
		cmd.Env = append(os.Environ(), "BERTH="+bin)
		out, err := cmd.CombinedOutput()
		if err != nil || !slices.Contains(strings.Fields(string(out)), want) {
			t.Errorf("completing %q: %v, got %q, want %q among them", words, err, out, want)
		}
	}
	if err := exec.Command(bin, "completion", "fish").Run(); err == nil {
		t.Error("berth completion fish: want an error")
	}
}

func TestUnknownCommand(t *testing.T) {
	cmd := exec.Command(berthBinary(t), "bogus")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() == 0 {
		t.Fatalf("berth bogus: %v, want a non-zero exit\n%s%s", err, stdout.String(), stderr.String())
	}
	if !strings.Contains(stderr.String(), `unknown command "bogus"`) {
		t.Errorf("stderr does not name the unknown command:\n%s", stderr.String())
	}
	if !strings.Contains(stderr.String(), "COMMANDS:") || !strings.Contains(stderr.String(), "serve") {
		t.Errorf("stderr lacks the usage:\n%s", stderr.String())
	}
}

// A berth killed outright leaves no lock behind (the kernel drops it) and
// only a stale socket, which the next berth replaces.
func TestServeAfterKill(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	sock, state := filepath.Join(dir, "csi.sock"), filepath.Join(dir, "state")
	first := serveBerth(t, berthArgs(sock, state, "a")...)
	mustServe(t, first, sock, "a")
	first.cmd.Process.Kill()
	<-first.done
	if _, err := os.Lstat(sock); err != nil {
		t.Fatalf("killed berth's socket: %v", err)
	}
	second := serveBerth(t, berthArgs(sock, state, "b")...)
	mustServe(t, second, sock, "b")
	second.stop(t)
}

// stopMargin is what a stopping berth needs beyond --shutdown-timeout:
// closing its sockets and the kubelet registration, and exiting.
const stopMargin = 10 * time.Second

// shutdownTimeout is berth serve's --shutdown-timeout in args, or its
// default.
func shutdownTimeout(t *testing.T, args []string) time.Duration {
	t.Helper()
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--shutdown-timeout="); ok {
			d, err := time.ParseDuration(v)
			if err != nil {
				t.Fatalf("%s: %v", a, err)
			}
			return d
		}
	}
	for _, f := range serveCommand().Flags {
		if d, ok := f.(*cli.DurationFlag); ok && d.Name == "shutdown-timeout" {
			return d.Value
		}
	}
	t.Fatal("berth serve has no --shutdown-timeout")
	return 0
}

// systemd stops berth.service with SIGTERM and kills what is left after
// TimeoutStopSec: that must leave berth its --shutdown-timeout to finish
// the calls in flight, or an unstage under way at shutdown is cut.
func TestServiceStopTimeoutCoversShutdownTimeout(t *testing.T) {
	unit, err := os.ReadFile(filepath.Join("systemd", "berth.service"))
	if err != nil {
		t.Fatal(err)
	}
	var stop, exec string
	for _, l := range strings.Split(string(unit), "\n") {
		if v, ok := strings.CutPrefix(l, "TimeoutStopSec="); ok {
			stop = v
		}
		if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
			exec = v
		}
	}
	d, err := time.ParseDuration(stop)
	if err != nil {
		t.Fatalf("berth.service TimeoutStopSec=%q: want a Go-readable span such as 90s: %v", stop, err)
	}
	if st := shutdownTimeout(t, strings.Fields(exec)); d < st+stopMargin {
		t.Errorf("berth.service TimeoutStopSec=%s, --shutdown-timeout %s: systemd kills berth before it has waited for the calls in flight; want at least %s", d, st, st+stopMargin)
	}
}
