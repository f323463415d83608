package nvmeof

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMNVMeoF boots a guest with the kernel's NVMe/TCP target (nvmet)
// and host, and runs the TestGuest* tests of this package there.
func TestVMNVMeoF(t *testing.T) {
	vm.RunGuestTests(t,
		vm.WithTestRun(guestRun("^TestGuest")),
		vm.WithTimeout(12*time.Minute),
	)
}

// guestRun narrows the in-guest tests to BERTH_NVMEOF_RUN when it is set
// (a regexp of in-guest test names), to iterate on one of them.
func guestRun(all string) string {
	if r := os.Getenv("BERTH_NVMEOF_RUN"); r != "" {
		return r
	}
	return all
}

// GuestRun is guestRun for the package's external tests (its fault
// tests' entry points).
var GuestRun = guestRun

func guestContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	return ctx
}

type testLogWriter struct{ t *testing.T }

func (w testLogWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// guestTransport returns a transport with its own uevent listener; the
// host identity is the guest's /etc/nvme, as on a real node.
func guestTransport(t *testing.T, staged func(context.Context) ([]map[string]string, error)) *Transport {
	t.Helper()
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	tr, err := NewTransport(Options{
		Listener:         l,
		Staged:           staged,
		NamespaceTimeout: 5 * time.Second,
		Logger:           slog.New(slog.NewTextHandler(testLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// controllersOf lists the live-or-reconnecting controllers of a subsystem.
func controllersOf(t *testing.T, nqn string) []Controller {
	t.Helper()
	cs, err := sysTree{}.readControllers(nqn)
	if err != nil {
		t.Fatal(err)
	}
	var out []Controller
	for _, c := range cs {
		if c.SubsysNQN == nqn && !c.Deleting() {
			out = append(out, c)
		}
	}
	return out
}

func wantControllers(t *testing.T, nqn string, n int) []Controller {
	t.Helper()
	cs := controllersOf(t, nqn)
	if len(cs) != n {
		t.Fatalf("%d controllers of %s, want %d: %+v", len(cs), nqn, n, cs)
	}
	return cs
}

func mustAttach(t *testing.T, ctx context.Context, tg *Target) *devices.Device {
	t.Helper()
	start := time.Now()
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	t.Logf("attached %s as %s in %v", tg.Key(), dev, time.Since(start).Round(time.Microsecond))
	// Leave no controller behind for the next test, even on failure.
	t.Cleanup(func() {
		if err := tg.Detach(context.Background(), nil); err != nil {
			t.Logf("cleanup: %v", err)
		}
	})
	return dev
}

// waitFor calls cond until it holds or d passes (test code only).
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

const (
	guestUUID1  = "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c"
	guestNGUID1 = "00112233-4455-6677-8899-aabbccddeeff"
)

func TestGuestAttachDetach(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	nqn := "nqn.2026-01.io.berth:attach"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4420"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20, UUID: guestUUID1, NGUID: guestNGUID1}}})

	tr := guestTransport(t, nil)
	tg, err := tr.Parse(map[string]string{"transport": "nvmeof", "nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4420"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dev := mustAttach(t, ctx, tg)
	if dev.ID.Kind != devices.KindNVMe || dev.ID.NQN != nqn || dev.ID.NSID != 1 || normalizeZeroID(dev.ID.UUID) != guestUUID1 {
		t.Errorf("device identity %+v", dev.ID)
	}
	if dev.Size != 64<<20 {
		t.Errorf("size %d, want %d", dev.Size, 64<<20)
	}
	var st unix.Stat_t
	if err := unix.Stat(dev.Path, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Errorf("%s is not a block device: %v", dev.Path, err)
	}
	host, err := tr.HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile("/etc/nvme/hostnqn"); err != nil || strings.TrimSpace(string(b)) != host.NQN {
		t.Errorf("/etc/nvme/hostnqn = %q, %v; want %s", b, err, host.NQN)
	}
	cs := wantControllers(t, nqn, 1)
	if cs[0].State != StateLive || cs[0].HostNQN != host.NQN || !strings.EqualFold(cs[0].HostID, host.ID) {
		t.Errorf("controller %+v", cs[0])
	}

	// A second attach reuses the controller and finds the same device.
	dev2 := mustAttach(t, ctx, tg)
	if dev2.Name != dev.Name || dev2.Major != dev.Major || dev2.Minor != dev.Minor {
		t.Errorf("second attach: %s, first %s", dev2, dev)
	}
	wantControllers(t, nqn, 1)
	if abnormal, msg := tg.Health(ctx); abnormal || !strings.Contains(msg, "1 of 1 paths up") {
		t.Errorf("Health = %v, %q", abnormal, msg)
	} else {
		t.Logf("health: %s", msg)
	}

	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatalf("Detach: %v", err)
	}
	wantControllers(t, nqn, 0)
	if _, err := os.Stat("/sys/block/" + dev.Name); err == nil {
		t.Errorf("%s still exists after detach", dev.Name)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Errorf("second Detach: %v", err)
	}
	if abnormal, msg := tg.Health(ctx); !abnormal {
		t.Errorf("Health after detach = %v, %q", abnormal, msg)
	}
}

func TestGuestReuseAndDuplicate(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	nqn := "nqn.2026-01.io.berth:reuse"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4424"},
		Namespaces: []target.NVMeNamespace{{Size: 32 << 20}}})
	tr := guestTransport(t, nil)
	host, err := tr.HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	// Someone (nvme-cli, an earlier berth) connected already.
	o := ConnectOptions{Transport: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4424", NQN: nqn, HostNQN: host.NQN, HostID: host.ID}
	s, err := o.Encode()
	if err != nil {
		t.Fatal(err)
	}
	inst, err := fabricsConnect(ctx, DefaultFabricsDevice, s)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	// The kernel refuses the same connect twice.
	if _, err := fabricsConnect(ctx, DefaultFabricsDevice, s); !errors.Is(err, errDuplicate) {
		t.Errorf("duplicate connect: %v, want errDuplicate", err)
	}
	wantControllers(t, nqn, 1)

	tg, err := tr.Parse(map[string]string{"targetTrAddr": "127.0.0.1", "targetTrPort": "4424", "targetTrType": "tcp", "nqn": nqn, "nsid": "1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	mustAttach(t, ctx, tg)
	cs := wantControllers(t, nqn, 1)
	if cs[0].Name != fmt.Sprintf("nvme%d", inst) {
		t.Errorf("attach used %s, the existing controller is nvme%d", cs[0].Name, inst)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	wantControllers(t, nqn, 0)
}

func TestGuestIdentity(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	nqn := "nqn.2026-01.io.berth:identity"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4425"},
		Namespaces: []target.NVMeNamespace{{Size: 32 << 20, UUID: guestUUID1, NGUID: guestNGUID1}}})
	tr := guestTransport(t, nil)
	base := map[string]string{"nqn": nqn, "traddr": "127.0.0.1", "trsvcid": "4425"}
	with := func(kv ...string) map[string]string {
		m := map[string]string{}
		for k, v := range base {
			m[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}

	// The wrong namespace: nothing appears, and the controller the
	// attach made is removed again.
	for _, vc := range []map[string]string{
		with("nsid", "1", "uuid", "11111111-2222-4333-8444-555555555555"),
		with("nsid", "2"),
		with("nguid", "ffeeddccbbaa99887766554433221100"),
	} {
		tg, err := tr.Parse(vc, nil)
		if err != nil {
			t.Fatal(err)
		}
		dev, err := tg.Attach(ctx)
		if err == nil {
			t.Fatalf("%v: attached %s", vc, dev)
		}
		if !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("%v: %v, want ErrNotFound", vc, err)
		}
		t.Logf("wrong namespace: %v", err)
		wantControllers(t, nqn, 0)
	}
	for _, vc := range []map[string]string{
		with("deviceUUID", strings.ToUpper(guestUUID1)),
		with("nguid", strings.ReplaceAll(guestNGUID1, "-", "")),
		with("nsid", "1", "uuid", guestUUID1, "nguid", guestNGUID1),
	} {
		tg, err := tr.Parse(vc, nil)
		if err != nil {
			t.Fatal(err)
		}
		dev := mustAttach(t, ctx, tg)
		if dev.ID.NSID != 1 {
			t.Errorf("%v: nsid %d", vc, dev.ID.NSID)
		}
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	}
}

// stagedList stands in for the agent's state: the volume contexts of
// staged volumes.
type stagedList struct {
	mu  sync.Mutex
	vcs []map[string]string
}

func (s *stagedList) set(vcs ...map[string]string) {
	s.mu.Lock()
	s.vcs = vcs
	s.mu.Unlock()
}

func (s *stagedList) list(context.Context) ([]map[string]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]map[string]string(nil), s.vcs...), nil
}

func TestGuestTwoNamespaces(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	nqn := "nqn.2026-01.io.berth:two"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4426"},
		Namespaces: []target.NVMeNamespace{{Size: 32 << 20}, {Size: 48 << 20}}})
	vc1 := map[string]string{"nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4426"}
	vc2 := map[string]string{"nqn": nqn, "nsid": "2", "traddr": "127.0.0.1", "trsvcid": "4426"}

	t.Run("agent state", func(t *testing.T) {
		staged := &stagedList{}
		tr := guestTransport(t, staged.list)
		tg1, _ := tr.Parse(vc1, nil)
		tg2, _ := tr.Parse(vc2, nil)
		staged.set(vc1, vc2)
		d1 := mustAttach(t, ctx, tg1)
		d2 := mustAttach(t, ctx, tg2)
		if d1.Name == d2.Name || d2.Size != 48<<20 {
			t.Fatalf("devices %s (%d) and %s (%d)", d1, d1.Size, d2, d2.Size)
		}
		wantControllers(t, nqn, 1)
		// Volume 1 goes; volume 2 is staged: the controller stays.
		if err := tg1.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 1)
		if abnormal, msg := tg2.Health(ctx); abnormal {
			t.Errorf("volume 2 after detaching volume 1: %s", msg)
		}
		// The agent has not dropped volume 1's record yet (it does so
		// after Detach returns): volume 2's detach still disconnects.
		if err := tg2.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
		// Restaging volume 1 takes it out of the released set again.
		mustAttach(t, ctx, tg1)
		mustAttach(t, ctx, tg2)
		staged.set(vc1, vc2)
		if err := tg2.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 1)
		staged.set(vc1)
		if err := tg1.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	})

	t.Run("kernel holders", func(t *testing.T) {
		tr := guestTransport(t, nil)
		tg1, _ := tr.Parse(vc1, nil)
		tg2, _ := tr.Parse(vc2, nil)
		d1 := mustAttach(t, ctx, tg1)
		d2 := mustAttach(t, ctx, tg2)
		// Namespace 2 is in use (as a mount would hold it).
		fd2, err := unix.Open(d2.Path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := tg1.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 1)
		// A namespace still held cannot be detached.
		if err := tg2.Detach(ctx, nil); !errors.Is(err, errdefs.ErrBusy) {
			t.Errorf("detach of a held namespace: %v, want ErrBusy", err)
		}
		wantControllers(t, nqn, 1)
		unix.Close(fd2)
		if err := tg2.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
		_ = d1
	})
}

func TestGuestMultipath(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	nqn := "nqn.2026-01.io.berth:multipath"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4430", "127.0.0.1:4431"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20, UUID: guestUUID1}}})
	tr := guestTransport(t, nil)
	tg, err := tr.Parse(map[string]string{"nqn": nqn, "uuid": guestUUID1,
		"targets": "127.0.0.1:4430,127.0.0.1:4431", "reconnectDelay": "1", "ctrlLossTmo": "-1", "ctrlLossForever": "true"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dev := mustAttach(t, ctx, tg)
	wantControllers(t, nqn, 2)
	// Attach returns with the head; the second path's namespace scan
	// may still be running.
	waitFor(t, 10*time.Second, "both paths showing the namespace", func() bool {
		abnormal, _ := tg.Health(ctx)
		return !abnormal
	})
	head, paths, err := tg.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if head != dev.Name || len(paths) != 2 || !paths[0].Healthy() || !paths[1].Healthy() {
		t.Fatalf("status %s %+v", head, paths)
	}
	t.Logf("paths: %+v", paths)
	// One head device, two hidden path devices under it.
	if nsPaths, err := (sysTree{}).readNamespacePaths(dev.Name); err != nil || len(nsPaths) != 2 {
		t.Fatalf("paths of %s: %+v, %v", dev.Name, nsPaths, err)
	}

	// Write continuously while one path goes away and comes back.
	f, err := os.OpenFile(dev.Path, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const block = 64 << 10
	const blocks = 256 // 16 MiB
	buf, err := unix.Mmap(-1, 0, block, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	sums := make([][32]byte, blocks)
	var writes atomic.Int64
	var writeErr atomic.Value
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			n := i % blocks
			for j := range buf {
				buf[j] = byte(i + j*7)
			}
			copy(buf, fmt.Sprintf("write %d", i))
			if _, err := f.WriteAt(buf, int64(n)*block); err != nil {
				writeErr.Store(fmt.Errorf("write %d: %w", i, err))
				return
			}
			sums[n] = sha256.Sum256(buf)
			writes.Add(1)
		}
	}()
	waitFor(t, 10*time.Second, "first writes", func() bool { return writes.Load() > 20 })

	tgt.RemovePort("127.0.0.1:4431")
	waitFor(t, 20*time.Second, "health showing the path down", func() bool {
		abnormal, _ := tg.Health(ctx)
		return abnormal
	})
	_, msg := tg.Health(ctx)
	t.Logf("one path down: %s", msg)
	if !strings.Contains(msg, "1 of 2 paths up") {
		t.Errorf("health message %q", msg)
	}
	before := writes.Load()
	waitFor(t, 10*time.Second, "writes through the remaining path", func() bool { return writes.Load() > before+50 })

	tgt.AddPort("127.0.0.1:4431")
	waitFor(t, 30*time.Second, "the path reconnecting", func() bool {
		abnormal, _ := tg.Health(ctx)
		return !abnormal
	})
	_, msg = tg.Health(ctx)
	t.Logf("path back: %s", msg)
	before = writes.Load()
	waitFor(t, 10*time.Second, "writes after the reconnect", func() bool { return writes.Load() > before+20 })

	// ANA: the target makes the port's group inaccessible; the host
	// learns it by AEN, I/O moves to the other path, Health says so.
	ana := anaStateFile(t, "4431")
	for _, tc := range []struct {
		state    string
		abnormal bool
	}{{"non-optimized", false}, {"inaccessible", true}, {"optimized", false}} {
		if err := os.WriteFile(ana, []byte(tc.state), 0o644); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 20*time.Second, "ANA state "+tc.state, func() bool {
			_, paths, err := tg.Status(ctx)
			return err == nil && len(paths) == 2 && paths[1].ANAState == tc.state
		})
		abnormal, msg := tg.Health(ctx)
		t.Logf("ANA %s: %s", tc.state, msg)
		if abnormal != tc.abnormal {
			t.Errorf("ANA %s: Health abnormal=%v, want %v", tc.state, abnormal, tc.abnormal)
		}
		if states, err := tg.PathStates(ctx); err != nil || (tc.abnormal && states[tc.state] != 1) || states["live"] != 2-states[tc.state] {
			t.Errorf("ANA %s: PathStates %v, %v", tc.state, states, err)
		}
		before = writes.Load()
		waitFor(t, 10*time.Second, "writes with ANA "+tc.state, func() bool { return writes.Load() > before+10 })
	}
	close(stop)
	<-done
	if err, _ := writeErr.Load().(error); err != nil {
		t.Fatalf("I/O error during path loss: %v", err)
	}
	t.Logf("%d writes of %d KiB without error", writes.Load(), block>>10)

	// What was written is what is read back.
	for n := 0; n < blocks && int64(n) < writes.Load(); n++ {
		if _, err := f.ReadAt(buf, int64(n)*block); err != nil {
			t.Fatal(err)
		}
		if sha256.Sum256(buf) != sums[n] {
			t.Fatalf("block %d: data differs from what was written", n)
		}
	}
	f.Close()
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	wantControllers(t, nqn, 0)
}

// anaStateFile is the ANA state of group 1 of the nvmet port on trsvcid.
func anaStateFile(t *testing.T, trsvcid string) string {
	t.Helper()
	ents, _ := os.ReadDir("/sys/kernel/config/nvmet/ports")
	for _, e := range ents {
		dir := "/sys/kernel/config/nvmet/ports/" + e.Name()
		if b, err := os.ReadFile(dir + "/addr_trsvcid"); err == nil && strings.TrimSpace(string(b)) == trsvcid {
			return dir + "/ana_groups/1/ana_state"
		}
	}
	t.Fatalf("no nvmet port on %s", trsvcid)
	return ""
}

// expandNoChangeMax bounds Expand of a namespace whose size did not
// change: one admin command to the controller, far below the second the
// agent once waited for a change that might still come.
const expandNoChangeMax = 400 * time.Millisecond

func TestGuestExpand(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	nqn := "nqn.2026-01.io.berth:expand"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4432"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}}})
	tr := guestTransport(t, nil)
	tg, err := tr.Parse(map[string]string{"nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4432"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dev := mustAttach(t, ctx, tg)
	defer tg.Detach(ctx, nil)
	if got, err := tg.Expand(ctx); err != nil || got != 64<<20 {
		t.Fatalf("Expand before growing: %d, %v", got, err)
	}

	// The target grows while ExpandTo waits.
	type result struct {
		size int64
		err  error
	}
	ch := make(chan result, 1)
	start := time.Now()
	go func() {
		s, err := tg.ExpandTo(ctx, 96<<20)
		ch <- result{s, err}
	}()
	time.Sleep(100 * time.Millisecond)
	tgt.Grow(1, 96<<20)
	r := <-ch
	if r.err != nil || r.size != 96<<20 {
		t.Fatalf("ExpandTo: %d, %v", r.size, r.err)
	}
	t.Logf("new size seen %v after ExpandTo started", time.Since(start).Round(time.Millisecond))
	if d, err := (devices.Roots{}).Lookup(dev.Name); err != nil || d.Size != 96<<20 {
		t.Errorf("device after expand: %+v, %v", d, err)
	}
	// Expand without a size asks the controller for the namespace's
	// size: when the kernel already has it there is nothing to wait for.
	start = time.Now()
	if got, err := tg.Expand(ctx); err != nil || got != 96<<20 {
		t.Fatalf("Expand with no change: %d, %v", got, err)
	}
	if d := time.Since(start); d > expandNoChangeMax {
		t.Errorf("Expand with no change took %v, want at most %v: the controller's answer was known long before", d.Round(time.Millisecond), expandNoChangeMax)
	}
	// Whether a grow lands before or after Expand asks the controller
	// depends on the guest's speed, so only the outcome is checked: once
	// the target has grown, Expand reports the new size.
	grown := make(chan struct{})
	go func() {
		defer close(grown)
		time.Sleep(100 * time.Millisecond)
		tgt.Grow(1, 112<<20)
	}()
	got, err := tg.Expand(ctx)
	if err != nil || (got != 96<<20 && got != 112<<20) {
		t.Fatalf("Expand while the target grows: %d, %v", got, err)
	}
	<-grown
	if got != 112<<20 {
		t.Logf("the grow arrived after Expand asked the controller; expanding again")
		start = time.Now()
		if got, err = tg.Expand(ctx); err != nil || got != 112<<20 {
			t.Fatalf("Expand after the target grew: %d, %v", got, err)
		}
		t.Logf("Expand after the target grew: %v", time.Since(start).Round(time.Millisecond))
	}
	// Already there: no wait.
	if s, err := tg.ExpandTo(ctx, 80<<20); err != nil || s != 112<<20 {
		t.Errorf("ExpandTo smaller: %d, %v", s, err)
	}

	// The target never grows: the error says so once the deadline passes.
	sctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = tg.ExpandTo(sctx, 1<<30)
	if err == nil || !strings.Contains(err.Error(), "still reports 117440512 bytes") || !strings.Contains(err.Error(), "has not announced the new size") {
		t.Errorf("ExpandTo beyond the target: %v", err)
	}
	if !bytes.Contains([]byte(fmt.Sprint(err)), []byte(dev.Name)) {
		t.Errorf("error %v does not name %s", err, dev.Name)
	}
}

// The target registers hosts by NQN: berth presents /etc/nvme/hostnqn.
func TestGuestHostNQN(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	tr := guestTransport(t, nil)
	host, err := tr.HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	ok := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:hosts-ok",
		AllowedHosts: []string{host.NQN}, Ports: []string{"127.0.0.1:4427"}})
	other := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:hosts-other",
		AllowedHosts: []string{"nqn.2026-01.io.example:another-node"}, Ports: []string{"127.0.0.1:4427"}})

	tg, err := tr.Parse(map[string]string{"nqn": ok.NQN(), "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4427"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	mustAttach(t, ctx, tg)
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}

	tg, err = tr.Parse(map[string]string{"nqn": other.NQN(), "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4427"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := tg.Attach(ctx)
	if err == nil {
		t.Fatalf("attached %s to a subsystem that does not allow this host", dev)
	}
	t.Logf("refused host: %v", err)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) && !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("error %v: want FailedPrecondition or PermissionDenied", err)
	}
	wantControllers(t, other.NQN(), 0)
}

// A target given by host name is resolved once, and the address is what
// the kernel gets; detach and health resolve it the same way.
func TestGuestHostName(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	hosts, _ := os.ReadFile("/etc/hosts")
	if err := os.WriteFile("/etc/hosts", append(hosts, []byte("\n127.0.0.1 nvme-array.berth.test\n")...), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile("/etc/hosts", hosts, 0o644) })
	nqn := "nqn.2026-01.io.berth:hostname"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4428"}})
	tr := guestTransport(t, nil)
	tg, err := tr.Parse(map[string]string{"nqn": nqn, "nsid": "1", "targets": "nvme-array.berth.test:4428"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	mustAttach(t, ctx, tg)
	cs := wantControllers(t, nqn, 1)
	if cs[0].Address.TrAddr != "127.0.0.1" || cs[0].Address.TrSvcID != "4428" {
		t.Errorf("controller address %+v", cs[0].Address)
	}
	if abnormal, msg := tg.Health(ctx); abnormal {
		t.Errorf("Health: %s", msg)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	wantControllers(t, nqn, 0)

	bad, err := tr.Parse(map[string]string{"nqn": nqn, "nsid": "1", "traddr": "no-such-host.berth.test"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.Attach(ctx); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "no-such-host.berth.test") {
		t.Errorf("unresolvable target: %v", err)
	}
}
