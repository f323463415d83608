package reliability

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/forklock"
	"github.com/berth-csi/berth/internal/testutil"
	"github.com/berth-csi/berth/test/vm"
)

const mib = 1 << 20

// A lifecycle is the RPCs kubelet sends for one volume, in order, with
// the test's own work (writing data, growing the image) between them.
type lifecycle struct {
	name   string
	fsType string // "" for a raw block volume
	size   int64
	expand bool
	// encrypted makes the volume LUKS2 (volume_context encrypted, the
	// passphrase in the stage and expand secrets).
	encrypted bool
}

func lifecycles(t *testing.T) []lifecycle {
	ls := []lifecycle{
		{name: "xfs", fsType: "xfs", size: 300 * mib, expand: true},
		{name: "block", size: 64 * mib, expand: true},
		// ext4 grows online only with CAP_SYS_RESOURCE, which root on
		// some hosts lacks (the VM suites cover it).
		{name: "ext4", fsType: "ext4", size: 64 * mib, expand: hasCapSysResource()},
	}
	return ls
}

// A backend is the storage side of a crash run: the transport berth
// serves, the volume's context, how the storage grows, and what of the
// transport a run can leave behind on the node.
type backend interface {
	// args are the flags of `berth serve` that enable the transport.
	args() []string
	volumeContext() map[string]string
	// grow enlarges the volume on the storage side to size bytes.
	grow(t *testing.T, size int64)
	// leftovers lists the transport's objects still on the node:
	// loop devices, controllers, sessions, node records, dm maps.
	leftovers() []string
}

// newBackend makes the storage of one volume of size bytes; dir is the
// run's own temporary directory. What it sets up it tears down with
// t.Cleanup.
type newBackend func(t *testing.T, dir string, size int64) backend

// env is one berth process tree's world: a volume of a backend, a state
// directory, staging and target paths, all below a temporary directory.
type env struct {
	t        *testing.T
	id       string // the volume ID, one per run: runs at once must not share names derived from it (a dm-crypt mapping's)
	bin      string
	dir      string
	state    string
	sock     string
	staging  string
	target   string
	lc       lifecycle
	be       backend
	cmd      *exec.Cmd
	logs     *bytes.Buffer
	node     csi.NodeClient
	conn     *grpc.ClientConn
	crashes  int
	uuid     string
	payload  []byte
	attempts int
	lost     int // payload bytes that did not read back
	why      string
}

// fatalf fails the run, keeping a short account of why for the
// progress line: a guest's test output reaches the host only when the
// guest is done, and CI may show only part of it.
func (e *env) fatalf(format string, args ...any) {
	e.t.Helper()
	msg := fmt.Sprintf(format, args...)
	first, _, _ := strings.Cut(msg, "\n")
	if len(first) > 400 {
		first = first[:400] + "…"
	}
	var tail []string
	if e.logs != nil {
		lines := strings.Split(strings.TrimRight(e.logs.String(), "\n"), "\n")
		tail = lines[max(0, len(lines)-15):]
	}
	e.why = first + "\n\tberth log, last lines:\n\t" + strings.Join(tail, "\n\t")
	e.t.Fatal(msg)
}

var envSeq atomic.Int32

func newEnv(t *testing.T, bin string, lc lifecycle, mk newBackend) *env {
	dir := t.TempDir()
	e := &env{t: t, bin: bin, dir: dir, state: filepath.Join(dir, "state"),
		sock: filepath.Join(dir, "csi.sock"), staging: filepath.Join(dir, "staging"), target: filepath.Join(dir, "pod", "vol"), lc: lc,
		id: fmt.Sprintf("vol-%d", envSeq.Add(1))}
	for _, d := range []string{e.staging, filepath.Dir(e.target)} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	// The backend's cleanup runs after the env's: berth stopped and
	// the volume unmounted before the storage goes.
	e.be = mk(t, dir, lc.size)
	t.Cleanup(e.cleanup)
	return e
}

// fileBackend is a file transport volume: an image below the file root.
type fileBackend struct {
	root string
	img  string
}

func newFileBackend(t *testing.T, dir string, size int64) backend {
	b := &fileBackend{root: filepath.Join(dir, "images")}
	b.img = filepath.Join(b.root, "vol.img")
	if err := os.MkdirAll(b.root, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(b.img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(b.img, size); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, dev := range b.loops() {
			_ = exec.Command("losetup", "-d", "/dev/"+dev).Run()
		}
	})
	return b
}

func (b *fileBackend) args() []string { return []string{"--file-root", b.root, "--transports", ""} }

func (b *fileBackend) volumeContext() map[string]string { return map[string]string{"file": "vol.img"} }

func (b *fileBackend) grow(t *testing.T, size int64) {
	if err := os.Truncate(b.img, size); err != nil {
		t.Fatal(err)
	}
}

// loops lists the loop devices of the image.
func (b *fileBackend) loops() []string {
	var out []string
	entries, _ := os.ReadDir("/sys/block")
	for _, en := range entries {
		bf, err := os.ReadFile(filepath.Join("/sys/block", en.Name(), "loop", "backing_file"))
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(bf)), b.img) {
			out = append(out, en.Name())
		}
	}
	return out
}

func (b *fileBackend) leftovers() []string {
	var out []string
	for _, dev := range b.loops() {
		out = append(out, "loop device "+dev)
	}
	return out
}

// start runs berth; env adds the failpoint variables of this run.
func (e *env) start(extraEnv ...string) {
	e.logs = &bytes.Buffer{}
	args := append([]string{"serve", "--endpoint", "unix://" + e.sock, "--node-id", "crash-node",
		"--state-dir", e.state, "--log-format", "text", "--log-level", "debug"}, e.be.args()...)
	cmd := exec.Command(e.bin, args...)
	cmd.Env = append(os.Environ(), extraEnv...)
	cmd.Stdout, cmd.Stderr = e.logs, e.logs
	if err := cmd.Start(); err != nil {
		e.fatalf("%v", err)
	}
	e.cmd = cmd
	// berth listens within milliseconds of its start; gRPC's default
	// reconnect backoff (1 s at first) would make every restart cost a
	// second.
	conn, err := grpc.NewClient("unix://"+e.sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, MaxDelay: 200 * time.Millisecond}, MinConnectTimeout: 5 * time.Second}))
	if err != nil {
		e.fatalf("%v", err)
	}
	e.conn, e.node = conn, csi.NewNodeClient(conn)
	// Generous: a guest without KVM on a busy host starts berth in
	// well under a second, but not always.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	id := csi.NewIdentityClient(conn)
	for {
		r, err := id.Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		if err == nil && r.GetReady().GetValue() {
			return
		}
		if ctx.Err() != nil || e.exited() {
			e.fatalf("berth not ready: %v\n%s", err, e.logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// killWait bounds the wait for a berth that left an RPC Unavailable to end.
const killWait = 60 * time.Second

func (e *env) exited() bool {
	return e.cmd.ProcessState != nil
}

// stop ends berth with SIGTERM, as systemd or kubelet would.
func (e *env) stop() {
	if e.cmd == nil {
		return
	}
	e.conn.Close()
	if e.cmd.ProcessState == nil {
		_ = e.cmd.Process.Signal(syscall.SIGTERM)
		_ = e.cmd.Wait()
	}
	e.cmd = nil
}

// killed reports whether berth died of SIGKILL (a failpoint), waiting for
// it to be reaped. A killed process ends only when each of its threads
// has left the kernel: one writing delete_controller or flushing a device
// when another hit the failpoint may take seconds more in a busy guest.
func (e *env) killed() bool {
	done := make(chan error, 1)
	go func() { done <- e.cmd.Wait() }()
	start := time.Now()
	select {
	case <-done:
	case <-time.After(killWait):
		e.t.Logf("berth did not end within %v of the RPC's Unavailable", killWait)
		return false
	}
	if d := time.Since(start); d > time.Second {
		e.t.Logf("berth ended %v after the RPC's Unavailable", d.Round(time.Millisecond))
	}
	ws, ok := e.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

func (e *env) capability() *csi.VolumeCapability {
	mode := &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}
	if e.lc.fsType == "" {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}, AccessMode: mode}
	}
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: e.lc.fsType}}, AccessMode: mode}
}

// call sends one RPC as kubelet does: until it succeeds. A berth that died
// of its failpoint is started again (without one) and the RPC retried.
// Before any crash every RPC must succeed at once; after one, an error is
// retried with a short backoff, as kubelet does (a tool the dead berth
// started may still hold the device for a moment).
func (e *env) call(name string, rpc func(ctx context.Context) error) {
	t := e.t
	for try := 0; ; try++ {
		if try > 20 {
			e.fatalf("%s: no success after %d tries\n%s", name, try, e.logs)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err := rpc(ctx)
		cancel()
		e.attempts++
		if err == nil {
			return
		}
		if status.Code(err) == codes.Unavailable && e.killed() {
			e.crashes++
			e.conn.Close()
			e.start()
			continue
		}
		if e.crashes == 0 {
			e.fatalf("%s: %v\nberth log:\n%s", name, err, e.logs)
		}
		t.Logf("%s after a crash: %v; retrying", name, err)
		time.Sleep(100 * time.Millisecond)
	}
}

func (e *env) vctx() map[string]string {
	vc := e.be.volumeContext()
	if e.lc.encrypted {
		// pbkdf2 at its lowest cost: argon2id costs seconds per open
		// in a guest without KVM.
		vc["encrypted"] = "true"
		vc["encryptionPBKDF"] = "pbkdf2"
		vc["encryptionPBKDFIterations"] = "1000"
	}
	return vc
}

// cryptPassphrase is the passphrase of the encrypted lifecycles.
const cryptPassphrase = "crash-suite passphrase"

func (e *env) secrets() map[string]string {
	if !e.lc.encrypted {
		return nil
	}
	return map[string]string{"encryptionPassphrase": cryptPassphrase}
}

func (e *env) stage() {
	e.call("NodeStageVolume", func(ctx context.Context) error {
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: e.id, StagingTargetPath: e.staging, VolumeCapability: e.capability(), VolumeContext: e.vctx(), Secrets: e.secrets()})
		return err
	})
}

func (e *env) publish() {
	e.call("NodePublishVolume", func(ctx context.Context) error {
		_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: e.id, StagingTargetPath: e.staging, TargetPath: e.target, VolumeCapability: e.capability(), VolumeContext: e.vctx()})
		return err
	})
}

func (e *env) unpublish() {
	e.call("NodeUnpublishVolume", func(ctx context.Context) error {
		_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: e.id, TargetPath: e.target})
		return err
	})
}

func (e *env) unstage() {
	e.call("NodeUnstageVolume", func(ctx context.Context) error {
		_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: e.id, StagingTargetPath: e.staging})
		return err
	})
}

func (e *env) expandVolume() {
	e.be.grow(e.t, 2*e.lc.size)
	path := e.target
	e.call("NodeExpandVolume", func(ctx context.Context) error {
		r, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: e.id, VolumePath: path, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * e.lc.size}, VolumeCapability: e.capability(), Secrets: e.secrets()})
		if err == nil && r.GetCapacityBytes() < 2*e.lc.size {
			return fmt.Errorf("expand: capacity %d, want %d", r.GetCapacityBytes(), 2*e.lc.size)
		}
		return err
	})
}

// write puts the payload on the volume through the pod's path and makes
// it durable. Its descriptors reach no child this process starts
// meanwhile (other crash runs start berth and tools): a copy would keep
// the pod's mount busy, and the unpublish that follows would fail.
func (e *env) write() {
	e.payload = []byte(fmt.Sprintf("data written at %s\n", time.Now().Format(time.RFC3339Nano)))
	if err := e.writePayload(); err != nil {
		e.fatalf("%v", err)
	}
	if e.lc.fsType != "" {
		e.uuid = e.fsUUID()
	}
}

func (e *env) writePayload() error {
	defer forklock.Hold()()
	p, flags, off := e.target, os.O_WRONLY, int64(1*mib)
	if e.lc.fsType != "" {
		p, flags, off = filepath.Join(e.target, "data"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0
	}
	f, err := os.OpenFile(p, flags, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.WriteAt(e.payload, off); err != nil {
		return err
	}
	return f.Sync()
}

// check reads the payload back through the pod's path (as write, out of
// the reach of children).
func (e *env) check(when string) {
	got, err := e.readPayload()
	if err != nil {
		e.lost = len(e.payload)
		e.fatalf("%s: %v", when, err)
	}
	if e.lc.fsType != "" {
		if u := e.fsUUID(); u != e.uuid {
			e.lost = len(e.payload)
			e.fatalf("%s: filesystem UUID %s, was %s: the volume was formatted again", when, u, e.uuid)
		}
	}
	if !bytes.Equal(got, e.payload) {
		e.lost = lostBytes(got, e.payload)
		e.fatalf("%s: data %q, want %q", when, got, e.payload)
	}
}

func (e *env) readPayload() ([]byte, error) {
	defer forklock.Hold()()
	if e.lc.fsType != "" {
		return os.ReadFile(filepath.Join(e.target, "data"))
	}
	f, err := os.Open(e.target)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	got := make([]byte, len(e.payload))
	if _, err := f.ReadAt(got, 1*mib); err != nil {
		return nil, err
	}
	return got, nil
}

// lostBytes counts the bytes of want that got does not hold.
func lostBytes(got, want []byte) int {
	n := 0
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			n++
		}
	}
	return n
}

func (e *env) fsUUID() string {
	out, err := exec.Command("findmnt", "-n", "-o", "UUID", "--target", e.target).Output()
	if err != nil {
		e.fatalf("findmnt %s: %v", e.target, err)
	}
	return strings.TrimSpace(string(out))
}

// run is the whole lifecycle: stage, publish, write, expand, unpublish,
// unstage, then stage and publish again to read the data back, and tear
// down.
func (e *env) run() {
	e.stage()
	e.publish()
	e.write()
	if e.lc.expand {
		e.expandVolume()
	}
	e.check("after expand")
	e.unpublish()
	e.unstage()
	e.stage()
	e.publish()
	e.check("after unstage and stage")
	e.unpublish()
	e.unstage()
}

// leftovers lists what the lifecycle left on the node: mounts below the
// test directory, the backend's devices, sessions and records, state
// records and temporary files, the pod's path.
func (e *env) leftovers() []string {
	var out []string
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], e.dir+"/") {
			out = append(out, "mount "+f[4])
		}
	}
	out = append(out, e.be.leftovers()...)
	out = append(out, berthMaps(e.id)...)
	states, _ := os.ReadDir(filepath.Join(e.state, "volumes"))
	for _, s := range states {
		out = append(out, "state file "+s.Name())
	}
	if _, err := os.Lstat(e.target); err == nil {
		out = append(out, "target path "+e.target)
	}
	return out
}

func (e *env) cleanup() {
	e.stop()
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], e.dir+"/") {
			mounts = append(mounts, f[4])
		}
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		_ = unix.Unmount(mounts[i], unix.MNT_DETACH)
	}
}

// berthMaps lists the device-mapper maps berth made for volume id (its
// dm-crypt mapping, "berth-<id>"): after a run, a leftover. Maps of
// other runs going at once are theirs.
func berthMaps(id string) []string {
	var out []string
	ents, _ := os.ReadDir("/sys/block")
	for _, e := range ents {
		name, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "dm", "name"))
		if n := strings.TrimSpace(string(name)); err == nil && n == "berth-"+id {
			out = append(out, "dm-crypt mapping "+e.Name()+" "+strconv.Quote(n))
		}
	}
	return out
}

type hit struct {
	n    int
	name string
}

func readTrace(t *testing.T, p string) []hit {
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var hits []hit
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		n, name, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			t.Fatalf("trace line %q", sc.Text())
		}
		i, err := strconv.Atoi(n)
		if err != nil {
			t.Fatal(err)
		}
		hits = append(hits, hit{i, name})
	}
	return hits
}

func hasCapSysResource() bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<24) != 0
		}
	}
	return false
}

// failpointBinary builds berth with failpoints (or takes
// BERTH_FAILPOINT_BIN).
func failpointBinary(t *testing.T) string {
	if b := os.Getenv("BERTH_FAILPOINT_BIN"); b != "" {
		return b
	}
	out := filepath.Join(t.TempDir(), "berth-failpoints")
	cmd := exec.Command("go", "build", "-tags", "failpoints", "-o", out, ".")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build berth with failpoints: %v\n%s", err, b)
	}
	return out
}

// A tally is one line of the reliability table: a transport's lifecycle
// crashed at each of its boundaries.
type tally struct {
	name      string // transport/lifecycle
	points    int    // boundaries traced, one crash run each
	converged int    // crash runs that converged with nothing left
	attempts  int    // RPCs sent in all crash runs, retries included
	lost      int    // payload bytes that did not read back
	leaks     int    // objects left behind after the runs
	took      time.Duration
}

func (r tally) row() string {
	return fmt.Sprintf("| %s | %d | %d | %d | %d | %d | %.0fs |", r.name, r.points, r.converged, r.attempts, r.lost, r.leaks, r.took.Seconds())
}

const tableHeader = "| transport/lifecycle | crash points | converged | RPC attempts | bytes lost | leaks | time |\n|---|---|---|---|---|---|---|"

// crashEveryStep runs lc once on a backend made by mk, tracing the
// boundaries berth passes, then once per traced boundary killing berth
// there, restarting it and retrying the RPC as kubelet would. Each run
// must converge: every RPC succeeds in the end, the data written before
// the crash reads back, the filesystem is the one first made (never
// formatted again), and nothing is left behind. The boundaries passed
// are added to reached. Up to parallel crash runs go at once, each with
// a volume, a berth and a state directory of its own.
func crashEveryStep(t *testing.T, bin, transport string, lc lifecycle, mk newBackend, reached map[string]bool, parallel int) tally {
	r := tally{name: transport + "/" + lc.name}
	start := time.Now()
	t.Run(lc.name, func(t *testing.T) {
		e := newEnv(t, bin, lc, mk)
		trace := filepath.Join(e.dir, "trace")
		e.start("BERTH_FAILPOINT_TRACE=" + trace)
		e.run()
		e.stop()
		if left := e.leftovers(); len(left) > 0 {
			t.Fatalf("the lifecycle without crashes left %q", left)
		}
		hits := readTrace(t, trace)
		if len(hits) == 0 {
			t.Fatal("no boundary traced: is the binary built with -tags failpoints?")
		}
		r.points = len(hits)
		var (
			mu  sync.Mutex // guards r
			wg  sync.WaitGroup
			sem = make(chan struct{}, max(parallel, 1))
		)
		for _, h := range hits {
			reached[h.name] = true
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				t.Run(fmt.Sprintf("%03d-%s", h.n, h.name), func(t *testing.T) {
					e := newEnv(t, bin, lc, mk)
					runStart := time.Now()
					leaks, converged := 0, 0
					defer func() {
						mu.Lock()
						r.attempts += e.attempts
						r.lost += e.lost
						r.leaks += leaks
						r.converged += converged
						mu.Unlock()
						progress("%s %d/%d %s: failed=%v, %v", r.name, h.n, len(hits), h.name, t.Failed(), time.Since(runStart).Round(time.Millisecond))
						if t.Failed() {
							why := e.why
							if why == "" {
								why = "no account kept: see the test's output"
							}
							progress("%s %d/%d %s failed: %s", r.name, h.n, len(hits), h.name, why)
							failedRuns.add(fmt.Sprintf("%s %03d-%s: %s", r.name, h.n, h.name, why))
						}
					}()
					e.start(fmt.Sprintf("BERTH_FAILPOINT_AT=%d", h.n))
					e.run()
					e.stop()
					if e.crashes != 1 {
						e.fatalf("berth was killed %d times, want once (at boundary %d, %s)", e.crashes, h.n, h.name)
					}
					if left := e.leftovers(); len(left) > 0 {
						leaks = len(left)
						e.fatalf("after a crash at boundary %d (%s): left %q", h.n, h.name, left)
					}
					converged = 1
				})
			}()
		}
		wg.Wait()
		t.Logf("%s: %d crash runs in %v", r.name, len(hits), time.Since(start).Round(time.Millisecond))
	})
	r.took = time.Since(start)
	return r
}

// progress shows a guest's progress on its console, which the host
// logs as it comes (the test output arrives when the guest is done).
func progress(format string, args ...any) {
	if !vm.InGuest() {
		return
	}
	f, err := os.OpenFile("/dev/console", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "crash suite: "+format+"\n", args...)
}

// failedRuns keeps the account of every crash run that failed, for the
// end of the report: CI may show only the head and the tail of a long
// output, and the guests' output comes as one block when they are done.
var failedRuns runLog

type runLog struct {
	mu   sync.Mutex
	runs []string
}

func (l *runLog) add(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.runs = append(l.runs, s)
}

// take returns the accounts kept so far and forgets them.
func (l *runLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	runs := l.runs
	l.runs = nil
	return runs
}

// guestReport collects the table rows and the failed runs' accounts a
// guest printed.
func guestReport(out string) (rows, failures []string) {
	return markedLines(out, rowMarker), guestFailures(out)
}

// reportTable prints the table of rows and the accounts of the failed
// runs, and appends them to the file named by TableEnv and to the same
// name with ".failures" added (make reliability prints the rows of every
// suite as one table, the failures below it). In a guest both go to the
// output, behind rowMarker and failureMarker, for the host half to
// collect.
func reportTable(t *testing.T, rows, failures []string) {
	if vm.InGuest() {
		printGuestReport(rowMarker, rows, failures)
		return
	}
	fmt.Printf("\n%s\n%s\n", tableHeader, strings.Join(rows, "\n"))
	for _, f := range failures {
		fmt.Printf("FAILED %s\n", f)
	}
	if err := appendReport("", tableHeader, rows, failures); err != nil {
		t.Fatal(err)
	}
}

// requireReached fails t for each boundary of want that no run reached.
func requireReached(t *testing.T, want []string, reached map[string]bool) {
	t.Helper()
	for _, name := range want {
		if !reached[name] {
			t.Errorf("step boundary %q is in the code but no crash test reaches it: extend the lifecycle", name)
		}
	}
}

// TestCrashAtEveryStep crashes berth at every step boundary of a file
// volume's whole life (see crashEveryStep), for each filesystem and raw
// block, and fails when a boundary in the host packages is never reached.
func TestCrashAtEveryStep(t *testing.T) {
	testutil.RequireRoot(t, "the crash suite: loop devices, mounts")
	bin := failpointBinary(t)
	reached := map[string]bool{}
	var rows []string
	for _, lc := range lifecycles(t) {
		rows = append(rows, crashEveryStep(t, bin, "file", lc, newFileBackend, reached, 1).row())
	}
	reportTable(t, rows, failedRuns.take())
	if t.Failed() {
		return
	}
	t.Run("every boundary is covered", func(t *testing.T) {
		// The steps of encrypted volumes need dm-crypt, which this host
		// lacks: the encrypted suite in a guest requires them.
		requireReached(t, slices.DeleteFunc(sourceBoundaries(t, hostPackages...), func(b string) bool {
			return slices.Contains(encryptedBoundaries, b) || slices.Contains(fenceBoundaries, b) || slices.Contains(takeoverBoundaries, b)
		}), reached)
	})
}

// encryptedBoundaries are the step boundaries only encrypted volumes
// pass: TestGuestCrashEncrypted requires them, TestCrashAtEveryStep (on
// a host without device-mapper) the others.
var encryptedBoundaries = []string{"step.open", "step.close", "step.resize_mapping", "exec.cryptsetup"}

// fenceBoundaries are the step boundaries only fenced volumes pass (a
// network transport's single-node writer): the iSCSI guest suite, whose
// LIO target has reservations, requires them.
var fenceBoundaries = []string{"step.fence", "step.unfence"}

// takeoverBoundaries are passed only when a stage takes another node's
// reservation over, which no crash suite does (each runs one node):
// TestVMFencing and TestVMNVMeFencing take volumes over between nodes,
// but crash nothing there.
var takeoverBoundaries = []string{"step.takeover"}
