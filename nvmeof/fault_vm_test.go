package nvmeof_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/reliability"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMNVMeoFFaults runs the fault tests (TestFault*): storage replaced
// behind a staged volume, a target that goes away and comes back. Each
// reports a row of make reliability's fault table.
func TestVMNVMeoFFaults(t *testing.T) {
	m := vm.RunGuestTests(t,
		vm.WithTestRun(nvmeof.GuestRun("^TestFault")),
		vm.WithTimeout(9*time.Minute),
	)
	reliability.ReportFaults(t, m.Output())
}

// faultVolume is one volume driven through the agent's gRPC API.
type faultVolume struct {
	node    csi.NodeClient
	id      string
	vctx    map[string]string
	cap     *csi.VolumeCapability
	staging string
	target  string
}

func newFaultVolume(t *testing.T, node csi.NodeClient, id string, vctx map[string]string) *faultVolume {
	t.Helper()
	dir := t.TempDir()
	v := &faultVolume{node: node, id: id, vctx: vctx, cap: csitest.MountCap("ext4"),
		staging: filepath.Join(dir, "staging"), target: filepath.Join(dir, "pod", "vol")}
	for _, d := range []string{v.staging, filepath.Dir(v.target)} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

func (v *faultVolume) stage(ctx context.Context) error {
	_, err := v.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		VolumeCapability: v.cap, VolumeContext: v.vctx})
	return err
}

func (v *faultVolume) publishAt(ctx context.Context, target string) error {
	_, err := v.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		TargetPath: target, VolumeCapability: v.cap, VolumeContext: v.vctx})
	return err
}

func (v *faultVolume) publish(ctx context.Context) error { return v.publishAt(ctx, v.target) }

func (v *faultVolume) unpublish(ctx context.Context) error {
	_, err := v.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
	return err
}

func (v *faultVolume) unstage(ctx context.Context) error {
	_, err := v.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	return err
}

func (v *faultVolume) stats(ctx context.Context, p string) (*csi.NodeGetVolumeStatsResponse, error) {
	return v.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: p})
}

func (v *faultVolume) expand(ctx context.Context, bytes int64) (*csi.NodeExpandVolumeResponse, error) {
	return v.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target,
		StagingTargetPath: v.staging, VolumeCapability: v.cap, CapacityRange: &csi.CapacityRange{RequiredBytes: bytes}})
}

// mountedDevice is the device number of the filesystem mounted at p.
func mountedDevice(t *testing.T, p string) (uint64, bool) {
	t.Helper()
	var st, parent unix.Stat_t
	if err := unix.Stat(p, &st); errors.Is(err, unix.ENOENT) {
		return 0, false
	} else if err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Dir(p), &parent); err != nil {
		t.Fatal(err)
	}
	return st.Dev, st.Dev != parent.Dev
}

// allZero reports whether the file (a target's backing file) holds only
// zeros, and where the first other byte is.
func allZero(t *testing.T, name string) (bool, int64) {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	zero := make([]byte, 1<<20)
	var off int64
	for {
		n, err := f.Read(buf)
		if n > 0 && !bytes.Equal(buf[:n], zero[:n]) {
			i := bytes.IndexFunc(buf[:n], func(r rune) bool { return r != 0 })
			return false, off + int64(i)
		}
		off += int64(n)
		if err == io.EOF {
			return true, 0
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// backingFile is the file behind a loop device.
func backingFile(t *testing.T, loop string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(loop), "loop", "backing_file"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// eventually calls cond until it holds or d passes (test code only).
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// wantRefused checks that a call failed with one of the codes.
func wantRefused(t *testing.T, what string, err error, codes ...codes.Code) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded on a volume whose storage was replaced", what)
		return
	}
	for _, c := range codes {
		if status.Code(err) == c {
			t.Logf("%s refused: %v", what, err)
			return
		}
	}
	t.Errorf("%s: %v, want one of %v", what, err, codes)
}

func wantAbnormal(t *testing.T, what string, resp *csi.NodeGetVolumeStatsResponse, err error) {
	t.Helper()
	switch {
	case err != nil && status.Code(err) == codes.FailedPrecondition:
		t.Logf("%s refused: %v", what, err)
	case err != nil:
		t.Errorf("%s: %v", what, err)
	case resp.GetVolumeCondition() == nil || !resp.GetVolumeCondition().GetAbnormal():
		t.Errorf("%s: condition %v after the namespace was replaced, want abnormal", what, resp.GetVolumeCondition())
	default:
		t.Logf("%s: abnormal: %s", what, resp.GetVolumeCondition().GetMessage())
	}
}

// TestFaultNamespaceReplaced: the namespace behind a staged and published
// volume is deleted on the target and its number reused for other
// storage (another NGUID and UUID). The volume_context names the
// namespace by number only, as many provisioners do. Once the host has
// rescanned, no RPC may use the new namespace as the volume: a repeated
// stage, a publish, an expand refuse, the stats report the volume
// abnormal, and a stage after its staging mount was lost refuses instead
// of formatting the new namespace. Nothing is written to it.
func TestFaultNamespaceReplaced(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "NVMe/TCP namespace replaced under its NSID")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	nqn := "nqn.2026-01.io.berth:replaced"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4450"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-replaced", map[string]string{"nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4450"})
	if err := v.stage(ctx); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if err := v.publish(ctx); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	payload := make([]byte, 256<<10)
	rand.Read(payload)
	f, err := os.Create(filepath.Join(v.target, "data"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(payload); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	unix.Sync()
	oldDev, _ := mountedDevice(t, v.staging)
	oldSys := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(oldDev), unix.Minor(oldDev))
	oldNGUID, _ := os.ReadFile(oldSys + "/nguid")
	t.Logf("staged on %s (nguid %s)", oldSys, strings.TrimSpace(string(oldNGUID)))

	start := time.Now()
	newBacking := backingFile(t, tgt.ReplaceNamespace(1, target.NVMeNamespace{}))
	// The target announces the change; the host's rescan finds other
	// identifiers under the number and drops the old namespace.
	eventually(t, 20*time.Second, "the host dropping the old namespace", func() bool {
		b, err := os.ReadFile(oldSys + "/nguid")
		return err != nil || !bytes.Equal(b, oldNGUID)
	})
	t.Logf("old namespace gone from the host %v after the replacement", time.Since(start).Round(time.Millisecond))

	// The staging mount is still there, over a device that is gone.
	resp, err := v.stats(ctx, v.staging)
	wantAbnormal(t, "NodeGetVolumeStats (staging path)", resp, err)
	resp, err = v.stats(ctx, v.target)
	wantAbnormal(t, "NodeGetVolumeStats (target path)", resp, err)
	wantRefused(t, "repeated NodeStageVolume", v.stage(ctx), codes.FailedPrecondition)
	second := filepath.Join(filepath.Dir(v.target), "vol2")
	wantRefused(t, "NodePublishVolume at another target", v.publishAt(ctx, second), codes.FailedPrecondition)
	if _, mounted := mountedDevice(t, second); mounted {
		t.Errorf("%s is mounted after a refused publish", second)
		unix.Unmount(second, unix.MNT_DETACH)
	}
	_, err = v.expand(ctx, 64<<20)
	wantRefused(t, "NodeExpandVolume", err, codes.FailedPrecondition)

	// The staging mount is lost (an operator unmounted the dead
	// filesystem; the pod's bind went with its container): the CO
	// stages again.
	for _, p := range []string{v.target, v.staging} {
		if err := unix.Unmount(p, 0); err != nil {
			t.Logf("unmount %s: %v; detaching it", p, err)
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The host finds the new namespace at its next rescan (the kernel
	// drops a namespace whose identifiers changed, and adds the new one
	// on the scan after).
	ctrls, _ := filepath.Glob("/sys/class/nvme/nvme*")
	for _, c := range ctrls {
		if b, err := os.ReadFile(c + "/subsysnqn"); err == nil && strings.TrimSpace(string(b)) == nqn {
			if err := os.WriteFile(c+"/rescan_controller", []byte("1"), 0o200); err != nil {
				t.Fatal(err)
			}
		}
	}
	newNGUID := tgt.Namespace(1).NGUID
	eventually(t, 20*time.Second, "the new namespace on the host", func() bool {
		heads, _ := filepath.Glob("/sys/block/nvme*")
		for _, h := range heads {
			if b, err := os.ReadFile(h + "/nguid"); err == nil && strings.TrimSpace(string(b)) == newNGUID {
				return true
			}
		}
		return false
	})
	wantRefused(t, "NodeStageVolume after the staging mount was lost", v.stage(ctx), codes.FailedPrecondition)
	if dev, mounted := mountedDevice(t, v.staging); mounted {
		t.Errorf("staging path mounted (device %d:%d) after the refused stage", unix.Major(dev), unix.Minor(dev))
	}
	wantRefused(t, "NodePublishVolume after the refused stage", v.publish(ctx), codes.FailedPrecondition)
	resp, err = v.stats(ctx, v.staging)
	wantAbnormal(t, "NodeGetVolumeStats after the refused stage", resp, err)
	if zero, off := allZero(t, newBacking); !zero {
		t.Errorf("the new namespace was written to (first non-zero byte at %d): it was used as the old volume", off)
	}

	// The CO gives up on the volume: unpublish and unstage clear it.
	if err := v.unpublish(ctx); err != nil {
		t.Errorf("NodeUnpublishVolume: %v", err)
	}
	if err := v.unstage(ctx); err != nil {
		t.Errorf("NodeUnstageVolume: %v", err)
	}
	if n := subsysControllers(t, nqn); n != 0 {
		t.Errorf("%d controllers left after unstage", n)
	}
	fault.Leaked(subsysControllers(t, nqn))
	if zero, off := allZero(t, newBacking); !zero {
		t.Errorf("the new namespace was written to by the unstage (first non-zero byte at %d)", off)
	}
}

// syncedWriter writes chunks to a file and fsyncs each one, until
// stopped; it remembers what every slot last held once fsync returned.
type syncedWriter struct {
	f       *os.File
	slots   int
	chunk   int
	acked   [][sha256.Size]byte
	written []bool
	n       atomic.Int64
	err     error
	maxSync time.Duration
	stop    chan struct{}
	done    chan struct{}
}

func startSyncedWriter(t *testing.T, name string, chunk, slots int) *syncedWriter {
	t.Helper()
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	w := &syncedWriter{f: f, slots: slots, chunk: chunk, acked: make([][sha256.Size]byte, slots), written: make([]bool, slots),
		stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	return w
}

func (w *syncedWriter) run() {
	defer close(w.done)
	buf := make([]byte, w.chunk)
	for i := 0; ; i++ {
		select {
		case <-w.stop:
			return
		default:
		}
		slot := i % w.slots
		seed := sha256.Sum256([]byte(fmt.Sprintf("write %d", i)))
		for j := 0; j < len(buf); j += len(seed) {
			copy(buf[j:], seed[:])
		}
		if _, err := w.f.WriteAt(buf, int64(slot*w.chunk)); err != nil {
			w.err = fmt.Errorf("write %d: %w", i, err)
			return
		}
		start := time.Now()
		if err := w.f.Sync(); err != nil {
			w.err = fmt.Errorf("fsync after write %d: %w", i, err)
			return
		}
		w.maxSync = max(w.maxSync, time.Since(start))
		w.acked[slot] = sha256.Sum256(buf)
		w.written[slot] = true
		w.n.Add(1)
	}
}

func (w *syncedWriter) finish() error {
	close(w.stop)
	<-w.done
	w.f.Close()
	return w.err
}

// check reads the file back and compares every slot with what its last
// acknowledged write put there; it returns the bytes of the slots that
// differ.
func (w *syncedWriter) check(t *testing.T, name string) int64 {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	bad := 0
	for s := 0; s < w.slots; s++ {
		if !w.written[s] {
			continue
		}
		end := (s + 1) * w.chunk
		if end > len(b) || sha256.Sum256(b[s*w.chunk:end]) != w.acked[s] {
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d fsync'd chunks differ from what was written", bad, w.slots)
	}
	return int64(bad * w.chunk)
}

// rpcTimes collects the durations of RPCs by name.
type rpcTimes map[string][]time.Duration

func (r rpcTimes) time(name string, fn func() error) error {
	start := time.Now()
	err := fn()
	r[name] = append(r[name], time.Since(start))
	return err
}

func (r rpcTimes) all() []time.Duration {
	var out []time.Duration
	for _, d := range r {
		out = append(out, d...)
	}
	slices.Sort(out)
	return out
}

func (r rpcTimes) String() string {
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(r)) {
		d := slices.Clone(r[name])
		slices.Sort(d)
		parts = append(parts, fmt.Sprintf("%s p50 %v max %v", name, d[len(d)/2].Round(time.Millisecond), d[len(d)-1].Round(time.Millisecond)))
	}
	all := r.all()
	return fmt.Sprintf("all %d: p50 %v max %v; %s", len(all), all[len(all)/2].Round(time.Millisecond), all[len(all)-1].Round(time.Millisecond), strings.Join(parts, ", "))
}

// cycle runs the RPCs a CO sends for a volume that is moved between pods:
// unpublish, unstage, stage, publish, stats; each within deadline.
func (v *faultVolume) cycle(t *testing.T, ctx context.Context, r rpcTimes, deadline time.Duration) {
	t.Helper()
	for _, step := range []struct {
		name string
		fn   func(ctx context.Context) error
	}{
		{"NodeUnpublishVolume", v.unpublish},
		{"NodeUnstageVolume", v.unstage},
		{"NodeStageVolume", v.stage},
		{"NodePublishVolume", v.publish},
		{"NodeGetVolumeStats", func(ctx context.Context) error {
			resp, err := v.stats(ctx, v.target)
			if err == nil && resp.GetVolumeCondition().GetAbnormal() {
				err = fmt.Errorf("condition abnormal: %s", resp.GetVolumeCondition().GetMessage())
			}
			return err
		}},
	} {
		if err := r.time(step.name, func() error {
			ctx, cancel := context.WithTimeout(ctx, deadline)
			defer cancel()
			return step.fn(ctx)
		}); err != nil {
			t.Fatalf("volume %s: %s (deadline %v): %v", v.id, step.name, deadline, err)
		}
	}
}

// TestFaultTargetOutage: the target of a published volume is unreachable
// for 20 s (its port is taken away, then put back) while a writer fsyncs
// chunk after chunk, well within ctrl_loss_tmo. The writer sees no error,
// every fsync'd chunk is on the target afterwards (read back after a
// fresh stage), the volume condition is abnormal during the outage with
// the path's state in its message and normal after it, and the RPCs of
// another volume on another subsystem answer as fast during the outage as
// before it.
func TestFaultTargetOutage(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "NVMe/TCP target outage of 20 s under fsync'd writes, beside a healthy volume")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	const downAddr, otherAddr = "127.0.0.1:4451", "127.0.0.1:4452"
	down := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:outage", Ports: []string{downAddr},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}}})
	other := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:bystander", Ports: []string{otherAddr},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-outage", map[string]string{"nqn": down.NQN(), "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4451",
		"ctrlLossTmo": "120", "reconnectDelay": "1"})
	b := newFaultVolume(t, node, "vol-bystander", map[string]string{"nqn": other.NQN(), "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4452"})
	for _, x := range []*faultVolume{v, b} {
		if err := x.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", x.id, err)
		}
		if err := x.publish(ctx); err != nil {
			t.Fatalf("NodePublishVolume %s: %v", x.id, err)
		}
	}
	// The other volume's RPCs with every target up: the baseline.
	before := rpcTimes{}
	for range 3 {
		b.cycle(t, ctx, before, 2*time.Minute)
	}
	t.Logf("RPCs of %s with every target up: %s", b.id, before)
	// An RPC that waited on the dead target would take most of the
	// outage. Under TCG on a loaded host a stage (fsck, mount) takes 0.5
	// to 2 s with every target up, so the deadline of each RPC during the
	// outage is 3 s, or three times the slowest RPC with every target up
	// on a host slower still.
	limit := max(3*time.Second, 3*before.all()[len(before.all())-1])

	data := filepath.Join(v.target, "data")
	w := startSyncedWriter(t, data, 16<<10, 1024)
	eventually(t, 10*time.Second, "the first fsync'd writes", func() bool { return w.n.Load() > 20 })

	const outage = 20 * time.Second
	start := time.Now()
	down.RemovePort(downAddr)
	t.Logf("target unreachable after %d fsync'd writes", w.n.Load())
	var abnormalMsg string
	eventually(t, 10*time.Second, "the volume condition showing the outage", func() bool {
		resp, err := v.stats(ctx, v.target)
		if err != nil {
			t.Fatalf("NodeGetVolumeStats during the outage: %v", err)
		}
		c := resp.GetVolumeCondition()
		abnormalMsg = c.GetMessage()
		return c.GetAbnormal()
	})
	t.Logf("condition %v into the outage: abnormal: %s", time.Since(start).Round(time.Millisecond), abnormalMsg)
	if !strings.Contains(abnormalMsg, "0 of 1 paths up") || !strings.Contains(abnormalMsg, "connecting") && !strings.Contains(abnormalMsg, "resetting") {
		t.Errorf("condition message %q does not name the path's state", abnormalMsg)
	}

	// The other volume's RPCs while this target is down.
	during := rpcTimes{}
	for time.Since(start) < outage-3*time.Second {
		b.cycle(t, ctx, during, limit)
		if err := during.time("NodeGetVolumeStats (volume whose target is down)", func() error {
			ctx, cancel := context.WithTimeout(ctx, limit)
			defer cancel()
			_, err := v.stats(ctx, v.target)
			return err
		}); err != nil {
			t.Fatalf("NodeGetVolumeStats %s during the outage (deadline %v): %v", v.id, limit, err)
		}
	}
	t.Logf("RPCs during the outage, each within %v: %s", limit, during)
	if n := w.n.Load(); w.err != nil {
		t.Fatalf("writer failed during the outage after %d writes: %v", n, w.err)
	}
	time.Sleep(time.Until(start.Add(outage)))
	downFor := time.Since(start)
	progress := w.n.Load()
	down.AddPort(downAddr)
	back := time.Now()
	var okMsg string
	eventually(t, 30*time.Second, "the volume condition showing recovery", func() bool {
		resp, err := v.stats(ctx, v.target)
		if err != nil {
			t.Fatalf("NodeGetVolumeStats after the outage: %v", err)
		}
		okMsg = resp.GetVolumeCondition().GetMessage()
		return !resp.GetVolumeCondition().GetAbnormal()
	})
	t.Logf("target down for %v; condition normal %v after it came back: %s", downFor.Round(time.Millisecond), time.Since(back).Round(time.Millisecond), okMsg)
	eventually(t, 30*time.Second, "writes after the outage", func() bool { return w.n.Load() > progress+20 })
	if err := w.finish(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	t.Logf("%d fsync'd writes of 16 KiB without error; longest fsync %v", w.n.Load(), w.maxSync.Round(time.Millisecond))
	if w.maxSync < outage/2 {
		t.Logf("note: no fsync waited through the outage (longest %v)", w.maxSync)
	}

	// What fsync acknowledged is on the target: read back through a
	// fresh stage (a new controller, nothing cached).
	if err := v.unpublish(ctx); err != nil {
		t.Fatal(err)
	}
	if err := v.unstage(ctx); err != nil {
		t.Fatal(err)
	}
	if err := v.stage(ctx); err != nil {
		t.Fatal(err)
	}
	if err := v.publish(ctx); err != nil {
		t.Fatal(err)
	}
	fault.Lost(w.check(t, data))
	for _, x := range []*faultVolume{v, b} {
		if err := x.unpublish(ctx); err != nil {
			t.Error(err)
		}
		if err := x.unstage(ctx); err != nil {
			t.Error(err)
		}
	}
	fault.Leaked(subsysControllers(t, down.NQN()) + subsysControllers(t, other.NQN()))
}

// TestFaultNodeRestart stands in for a reboot of the node with volumes
// staged and published (the harness keeps no disk between two boots of a
// guest, so the reboot is simulated in one): berth is killed (SIGKILL,
// as by a power cut), then everything the kernel held goes, as it does
// at a reboot: the publish and staging mounts, the controllers and with
// them the devices. The state directory and the CO's directories stay,
// as on a node's disk. berth starts again on the same state, answers its
// probe and the stats of the volumes (abnormal), and kubelet's re-stage
// and re-publish of every volume bring back each one with its data: a
// filesystem volume and a raw block volume.
func TestFaultNodeRestart(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "NVMe/TCP node power cut with 2 volumes published, then re-staged")
	dir := t.TempDir()
	nqn := "nqn.2026-01.io.berth:restart"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4453"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}, {Size: 32 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	b := startBerth(t, dir)
	b.node = fault.Node(b.node)
	vctx := func(nsid string) map[string]string {
		return map[string]string{"transport": "nvmeof", "nqn": nqn, "nsid": nsid, "traddr": "127.0.0.1", "trsvcid": "4453"}
	}
	fsVol := newFaultVolume(t, b.node, "restart-fs", vctx("1"))
	blockVol := newFaultVolume(t, b.node, "restart-block", vctx("2"))
	blockVol.cap = csitest.BlockCap()
	if err := os.WriteFile(blockVol.target, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	vols := []*faultVolume{fsVol, blockVol}
	for _, v := range vols {
		if err := v.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", v.id, err)
		}
		if err := v.publish(ctx); err != nil {
			t.Fatalf("NodePublishVolume %s: %v", v.id, err)
		}
	}
	payload := make([]byte, 1<<20)
	rand.Read(payload)
	writeSynced := func(name string, flag int) {
		f, err := os.OpenFile(name, flag, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt(payload, 0); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
	}
	fsData := filepath.Join(fsVol.target, "data")
	writeSynced(fsData, os.O_RDWR|os.O_CREATE)
	writeSynced(blockVol.target, os.O_RDWR)

	// The power goes: berth dies without a word, the kernel's state with it.
	b.cmd.Process.Kill()
	b.cmd.Wait()
	b.conn.Close()
	b.cmd = nil
	for _, p := range []string{fsVol.target, blockVol.target, fsVol.staging} {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			t.Fatalf("unmount %s: %v", p, err)
		}
	}
	ctrls, _ := filepath.Glob("/sys/class/nvme/nvme*")
	for _, c := range ctrls {
		if s, err := os.ReadFile(c + "/subsysnqn"); err == nil && strings.TrimSpace(string(s)) == nqn {
			if err := os.WriteFile(c+"/delete_controller", []byte("1"), 0o200); err != nil {
				t.Fatal(err)
			}
		}
	}
	eventually(t, 20*time.Second, "the controllers gone", func() bool { return subsysControllers(t, nqn) == 0 })

	start := time.Now()
	b = startBerth(t, dir)
	b.node = fault.Node(b.node)
	t.Logf("berth ready %v after its start on the old state", time.Since(start).Round(time.Millisecond))
	for _, v := range vols {
		v.node = b.node
		p := v.target
		if v.cap.GetBlock() == nil {
			p = v.staging
		}
		resp, err := v.stats(ctx, p)
		switch {
		case err != nil:
			t.Logf("NodeGetVolumeStats %s before the re-stage: %v", v.id, err)
		case !resp.GetVolumeCondition().GetAbnormal():
			t.Errorf("NodeGetVolumeStats %s before the re-stage: condition normal (%s), want abnormal", v.id, resp.GetVolumeCondition().GetMessage())
		default:
			t.Logf("NodeGetVolumeStats %s before the re-stage: abnormal: %s", v.id, resp.GetVolumeCondition().GetMessage())
		}
	}
	// kubelet stages and publishes again what its pods use.
	for _, v := range vols {
		start := time.Now()
		if err := v.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s after the restart: %v", v.id, err)
		}
		if err := v.publish(ctx); err != nil {
			t.Fatalf("NodePublishVolume %s after the restart: %v", v.id, err)
		}
		t.Logf("%s staged and published again in %v", v.id, time.Since(start).Round(time.Millisecond))
		resp, err := v.stats(ctx, v.target)
		if err != nil || resp.GetVolumeCondition().GetAbnormal() {
			t.Errorf("NodeGetVolumeStats %s after the re-stage: %v, %v", v.id, resp.GetVolumeCondition(), err)
		}
	}
	for _, name := range []string{fsData, blockVol.target} {
		f, err := os.Open(name)
		if err != nil {
			fault.Lost(int64(len(payload)))
			t.Fatal(err)
		}
		got := make([]byte, len(payload))
		n, err := io.ReadFull(f, got)
		f.Close()
		fault.Lost(differing(got[:n], payload))
		if err != nil || !bytes.Equal(got, payload) {
			t.Errorf("%s after the restart: %v, data equal %v", name, err, bytes.Equal(got, payload))
		}
	}
	for _, v := range vols {
		if err := v.unpublish(ctx); err != nil {
			t.Error(err)
		}
		if err := v.unstage(ctx); err != nil {
			t.Error(err)
		}
	}
	if n := subsysControllers(t, nqn); n != 0 {
		t.Errorf("%d controllers left after unstage", n)
	}
	fault.Leaked(subsysControllers(t, nqn))
}

// differing counts the bytes of want that got does not hold.
func differing(got, want []byte) int64 {
	var n int64
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			n++
		}
	}
	return n
}

// TestFaultSilentPath: a subsystem has two paths and the first drops
// every packet: a black hole (no SYN-ACK, no RST), or a listener that
// accepts and never answers. Four volumes of the subsystem are staged at
// once: each succeeds over the live path within 25 s, and its condition
// names the silent path.
func TestFaultSilentPath(t *testing.T) {
	vm.RequireGuest(t)
	t.Run("BlackHole", func(t *testing.T) { testSilentPath(t, "black hole", target.BlackHole(t)+":4454") })
	t.Run("NoAnswer", func(t *testing.T) {
		const dead = "127.0.0.2:4455"
		target.SilentListener(t, dead)
		testSilentPath(t, "no answer", dead)
	})
}

func testSilentPath(t *testing.T, silence, dead string) {
	fault := reliability.StartFault(t, "NVMe/TCP silent first path ("+silence+"), 4 volumes of its subsystem staged at once")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	_, port, _ := strings.Cut(dead, ":")
	live := "127.0.0.1:" + port
	nqn := "nqn.2026-01.io.berth:silent-" + port
	const n = 4
	nss := make([]target.NVMeNamespace, n)
	for i := range nss {
		nss[i].Size = 64 << 20
	}
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{live}, Namespaces: nss})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// The kernel gives up on a path in a few seconds (one SYN retry, or
	// 10 s for an ICResp that never comes); the first stage pays that, and
	// the stages of the subsystem's other volumes, at once, need not pay
	// it again one after the other.
	const bound = 25 * time.Second
	vols := make([]*faultVolume, n)
	var wg sync.WaitGroup
	for i := range vols {
		v := newFaultVolume(t, node, fmt.Sprintf("vol-silent-%d", i+1), map[string]string{"nqn": nqn, "nsid": strconv.Itoa(i + 1), "targets": dead + "," + live})
		vols[i] = v
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, bound)
			defer cancel()
			start := time.Now()
			if err := v.stage(ctx); err != nil {
				t.Errorf("NodeStageVolume %s with a silent path: %v after %v", v.id, err, time.Since(start))
				return
			}
			took := time.Since(start)
			t.Logf("%s staged over the live path in %v", v.id, took.Round(time.Millisecond))
			if took > bound {
				t.Errorf("stage of %s took %v, more than %v", v.id, took, bound)
			}
		})
	}
	wg.Wait()
	for _, v := range vols {
		resp, err := v.stats(ctx, v.staging)
		switch {
		case err != nil:
			t.Errorf("NodeGetVolumeStats %s: %v", v.id, err)
		case !resp.GetVolumeCondition().GetAbnormal() || !strings.Contains(resp.GetVolumeCondition().GetMessage(), dead):
			t.Errorf("condition of %s %v: want abnormal, naming the silent path %s", v.id, resp.GetVolumeCondition(), dead)
		}
	}
	for _, v := range vols {
		if err := v.unstage(ctx); err != nil {
			t.Errorf("NodeUnstageVolume %s: %v", v.id, err)
		}
	}
	ctrls, _ := filepath.Glob("/sys/class/nvme/nvme*")
	if len(ctrls) != 0 {
		t.Errorf("controllers left after unstage: %q", ctrls)
	}
	fault.Leaked(len(ctrls))
}

// TestFaultDeadSubsystemUnstage: two volumes of one subsystem are staged
// and published with data written, then every path to the subsystem dies
// (its port removed) and both are unstaged at once, as a node drain or the
// CO after a lost target does. Each unstage sees the other volume still
// mounted on the subsystem; neither may keep the controllers for the
// other and wait, in the kernel, for ctrl_loss_tmo: both finish within the
// kubelet's budget, and no controller is left. With the subsystem back,
// each volume stages again with the data synced before the paths died.
func TestFaultDeadSubsystemUnstage(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "dead shared NVMe/TCP subsystem, its 2 volumes unstaged at once")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	const addr = "127.0.0.1:4456"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:dead-shared", Ports: []string{addr},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}, {Size: 64 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	synced := bytes.Repeat([]byte("x"), 1<<20)
	var vols []*faultVolume
	for _, nsid := range []string{"1", "2"} {
		v := newFaultVolume(t, node, "vol-dead-"+nsid, map[string]string{"nqn": tgt.NQN(), "nsid": nsid, "traddr": "127.0.0.1", "trsvcid": "4456",
			"ctrlLossTmo": "600", "reconnectDelay": "1"})
		if err := v.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", v.id, err)
		}
		if err := v.publish(ctx); err != nil {
			t.Fatalf("NodePublishVolume %s: %v", v.id, err)
		}
		if err := os.WriteFile(filepath.Join(v.target, "data"), synced, 0o644); err != nil {
			t.Fatal(err)
		}
		vols = append(vols, v)
	}
	unix.Sync()
	// Dirty pages the dead target will never get: the unmounts must
	// not wait for them.
	for _, v := range vols {
		if err := os.WriteFile(filepath.Join(v.target, "late"), bytes.Repeat([]byte("y"), 1<<20), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tgt.RemovePort(addr)
	eventually(t, 15*time.Second, "the subsystem's controller leaving the live state", func() bool {
		resp, err := vols[0].stats(ctx, vols[0].target)
		return err == nil && resp.GetVolumeCondition().GetAbnormal()
	})
	// The kubelet gives an unstage call 2 minutes.
	const budget = 2 * time.Minute
	var wg sync.WaitGroup
	for _, v := range vols {
		wg.Go(func() {
			if err := v.unpublish(ctx); err != nil {
				t.Errorf("NodeUnpublishVolume %s: %v", v.id, err)
			}
			cctx, cancel := context.WithTimeout(ctx, budget)
			defer cancel()
			start := time.Now()
			err := v.unstage(cctx)
			t.Logf("NodeUnstageVolume %s: %v after %v", v.id, err, time.Since(start).Round(time.Millisecond))
			if err != nil {
				t.Errorf("NodeUnstageVolume %s with every path of its subsystem dead: %v", v.id, err)
			}
		})
	}
	wg.Wait()
	if n := subsysControllers(t, tgt.NQN()); n != 0 {
		t.Errorf("%d controllers of the dead subsystem left after both unstages", n)
	}
	fault.Leaked(subsysControllers(t, tgt.NQN()))

	// The subsystem comes back: what was synced before it died is there.
	tgt.AddPort(addr)
	for _, v := range vols {
		if err := v.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s with the subsystem back: %v", v.id, err)
		}
		if err := v.publish(ctx); err != nil {
			t.Fatalf("NodePublishVolume %s with the subsystem back: %v", v.id, err)
		}
		got, err := os.ReadFile(filepath.Join(v.target, "data"))
		fault.Lost(differing(got, synced))
		if err != nil || !bytes.Equal(got, synced) {
			t.Errorf("%s staged again: %d bytes (%v), %d of the %d synced before the paths died differ or are missing",
				v.id, len(got), err, differing(got, synced), len(synced))
		}
		if err := v.unpublish(ctx); err != nil {
			t.Error(err)
		}
		if err := v.unstage(ctx); err != nil {
			t.Error(err)
		}
	}
	fault.Leaked(subsysControllers(t, tgt.NQN()))
}
