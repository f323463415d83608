package nvmeof_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// The NVMe fencing guests: one nvmet target, two nodes running berth,
// each on a private link of its own to the target and with a host NQN and
// host ID of its own (nvmet tells registrants apart by host ID). The
// namespace is a raw block volume with reservations.
const (
	nfNQN       = "nqn.2014-08.io.berth:fence"
	nfRegion    = 1024 // 4 KiB records the writer cycles through
	nfRecSize   = 4096
	nfCheckHost = "nqn.2014-08.io.berth:fence-check"
	nfCheckID   = "3b3b3b3b-0000-4000-8000-00000000000c"
)

var nfNodes = map[string]struct{ nqn, hostID, addr, portal string }{
	"node-a": {"nqn.2014-08.io.berth:node-a", "3b3b3b3b-0000-4000-8000-00000000000a", "192.168.81.2/24", "192.168.81.1"},
	"node-b": {"nqn.2014-08.io.berth:node-b", "3b3b3b3b-0000-4000-8000-00000000000b", "192.168.82.2/24", "192.168.82.1"},
}

// TestVMNVMeFencing boots the target and the two nodes once, on the 7.3
// kernel (nvmet has reservations since 6.13), and runs the fencing cases
// of issue 30 over NVMe/TCP in order, each checked on the target: a third
// host there reads the Reservation Report, and an oracle reads the
// namespace's backing device.
func TestVMNVMeFencing(t *testing.T) {
	t.Parallel()
	common := []vm.Option{vm.WithKernel("trixie-backports"), vm.WithTimeout(12 * time.Minute)}
	linkA, linkB := vm.NewLink(t), vm.NewLink(t)
	tgt := vm.Boot(t, append(common, vm.WithName("nvme-fence-target"), vm.WithTestRun("^TestNVMeFenceGuestTarget$"),
		vm.WithModules("nvmet", "nvmet_tcp", "nvme_tcp"),
		vm.WithNIC(linkA, "192.168.81.1/24"), vm.WithNIC(linkB, "192.168.82.1/24"))...)
	node := func(name, run string, link *vm.Link) *vm.Machine {
		n := nfNodes[name]
		dir := t.TempDir()
		files := map[string]string{}
		for f, v := range map[string]string{"hostnqn": n.nqn, "hostid": n.hostID} {
			p := filepath.Join(dir, f)
			if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			files[p] = "/etc/nvme/" + f
		}
		return vm.Boot(t, append(common, vm.WithName(name), vm.WithTestRun(run), vm.WithModules("nvme_tcp"),
			vm.WithExtraFiles(files), vm.WithNIC(link, n.addr), vm.WithEnv(map[string]string{"BERTH_FENCE_TRADDR": n.portal}))...)
	}
	a := node("node-a", "^TestNVMeFenceGuestNodeA$", linkA)
	b := node("node-b", "^TestNVMeFenceGuestNodeB$", linkB)
	const step = 4 * time.Minute
	tgt.WaitSignal("target-ready", step)
	a.WaitSignal("ready", step)
	b.WaitSignal("ready", step)
	// A guest's signals are a set: each step's name carries its number
	// among the machine's steps, so that a repeated step waits for its
	// own answer.
	seq := map[*vm.Machine]int{}
	do := func(m *vm.Machine, name string) {
		t.Helper()
		name = fmt.Sprintf("%d-%s", seq[m], name)
		seq[m]++
		m.Send(name)
		m.WaitSignal(name+"-done", step)
	}
	check := func(name string) { t.Helper(); do(tgt, "check-"+name) }

	// 1: A stages the raw block volume and writes records.
	do(a, "stage-blk")
	check("a-holds")
	// 2: B without authorisation is refused; A unchanged.
	do(b, "stage-blk-refused")
	check("a-holds")
	// 3: A hangs; B, authorised by berth takeover, preempts it and
	// writes its fence marker over the region.
	a.Pause()
	do(b, "takeover-blk")
	check("b-holds")
	// 4: A goes on: its writes fail and none reaches the medium.
	a.Resume()
	do(a, "resumed")
	check("oracle")
	// 5: A (refused again, reported preempted) unstages; B untouched.
	do(a, "unstage-fenced")
	check("b-holds")
	// 6: the graceful move back.
	do(b, "unstage-blk")
	check("free")
	do(a, "stage-back")
	check("a-holds")
	do(a, "unstage-blk")
	check("free")
	// 7: A's host left registered with key 0 (IOC_PR_REGISTER to key 0,
	// which on NVMe replaces the key): a registrant that writes. A stage
	// gives it the node's key and takes the reservation.
	do(a, "key-zero")
	check("zero")
	do(a, "stage-reclaim")
	check("a-holds")
	do(a, "unstage-blk")
	check("free")
	// The cost: stage times with and without fencing.
	do(a, "timings")
	check("free")
	for _, m := range []*vm.Machine{tgt, a, b} {
		m.Send("stop")
	}
	tgt.ReportTests(t)
	a.ReportTests(t)
	b.ReportTests(t)
}

// TestNVMeFenceGuestTarget serves the namespace and answers the host's
// checks through a controller of its own (host nfCheckHost, which never
// registers) over loopback.
func TestNVMeFenceGuestTarget(t *testing.T) {
	vm.RequireGuest(t)
	x := target.NewNVMeTarget(t, target.NVMeConfig{
		NQN:        nfNQN,
		Namespaces: []target.NVMeNamespace{{Size: 32 << 20, Reservations: true}},
		Ports:      []string{"0.0.0.0:4420"},
	})
	pr := nfCheckDevice(t, x)
	read := func() devices.Reservation {
		t.Helper()
		r, err := pr.ReadReservation()
		if err != nil {
			t.Fatalf("read the reservation: %v", err)
		}
		return r
	}
	vm.SignalHost("target-ready")
	holds := func(node string) {
		t.Helper()
		r := read()
		k := agent.NodeKey(node)
		if r.Holder != k || r.Type != devices.PRWriteExclusiveRegOnly || !slices.Equal(r.Keys, []uint64{k}) {
			t.Errorf("want %s (key %#016x) the only registrant and holder of Write Exclusive - Registrants Only: %+v", node, k, r)
		}
	}
	free := func() {
		t.Helper()
		if r := read(); len(r.Keys) != 0 || r.Type != 0 {
			t.Errorf("want no registrant and no reservation: %+v", r)
		}
	}
	steps := []struct {
		name string
		fn   func()
	}{
		{"a-holds", func() { holds("node-a") }},
		{"a-holds", func() { holds("node-a") }},
		{"b-holds", func() { holds("node-b") }},
		{"oracle", func() { nfOracle(t, x.BackingDevice(1)) }},
		{"b-holds", func() { holds("node-b") }},
		{"free", free},
		{"a-holds", func() { holds("node-a") }},
		{"free", free},
		{"zero", func() {
			if r := read(); !slices.Equal(r.Keys, []uint64{0}) || r.Type != 0 {
				t.Errorf("want one registrant with key 0, no reservation: %+v", r)
			}
		}},
		{"a-holds", func() { holds("node-a") }},
		{"free", free},
		{"free", free},
	}
	for i, s := range steps {
		name := fmt.Sprintf("%d-check-%s", i, s.name)
		vm.WaitHost(t, name)
		s.fn()
		t.Logf("check %s: %+v", s.name, read())
		vm.SignalHost(name + "-done")
	}
	vm.WaitHost(t, "stop")
}

// nfCheckDevice connects the target guest's own host to the subsystem
// over loopback and opens the namespace's head for reservation reads.
func nfCheckDevice(t *testing.T, x *target.NVMeTarget) *devices.PR {
	f, err := os.OpenFile("/dev/nvme-fabrics", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	opts := x.ConnectString("127.0.0.1:4420") + ",hostnqn=" + nfCheckHost + ",hostid=" + nfCheckID
	if _, err := f.WriteString(opts); err != nil {
		f.Close()
		t.Fatalf("connect %s: %v", opts, err)
	}
	f.Close()
	var path string
	deadline := time.Now().Add(30 * time.Second)
	for path == "" {
		ms, _ := filepath.Glob("/sys/block/nvme*n1")
		for _, m := range ms {
			if b, err := os.ReadFile(filepath.Join(m, "device", "subsysnqn")); err == nil && strings.TrimSpace(string(b)) == nfNQN && !strings.Contains(filepath.Base(m), "c") {
				path = "/dev/" + filepath.Base(m)
			}
		}
		if path == "" {
			if time.Now().After(deadline) {
				t.Fatalf("no namespace head of %s appeared: %v", nfNQN, ms)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	var st unix.Stat_t
	for unix.Stat(path, &st) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("no device node %s", path)
		}
		time.Sleep(50 * time.Millisecond)
	}
	d := &devices.Device{Name: filepath.Base(path), Path: path, Major: unix.Major(st.Rdev), Minor: unix.Minor(st.Rdev), ID: devices.Identity{Kind: devices.KindNVMe}}
	pr, err := devices.OpenPR(d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pr.Close() })
	return pr
}

// nfOracle reads the record region of the namespace's backing device,
// bypassing caches: every block must be B's fence marker; a record of
// node A there was written after the fence.
func nfOracle(t *testing.T, dev string) {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := nfAligned(nfRegion * nfRecSize)
	if _, err := f.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	fromA, markers := 0, 0
	for i := range nfRegion {
		b := buf[i*nfRecSize : (i+1)*nfRecSize]
		switch {
		case bytes.HasPrefix(b, []byte("FENCE-REC node-a")):
			fromA++
		case bytes.HasPrefix(b, []byte("FENCE-MARK node-b")):
			markers++
		}
	}
	t.Logf("oracle: %d records from node-a after node-b's fence, %d fence markers of %d blocks", fromA, markers, nfRegion)
	if fromA != 0 || markers != nfRegion {
		t.Errorf("oracle: %d records of the fenced node reached the medium after the fence (want 0), %d of %d markers left", fromA, markers, nfRegion)
	}
}

func nfAligned(n int) []byte {
	b := make([]byte, n+4096)
	off := (4096 - int(uintptr(unsafe.Pointer(&b[0]))%4096)) % 4096
	return b[off : off+n]
}

// nfNode is a node guest: berth's agent over the nvmeof transport with
// the operator's takeover authority, as berth serve has it.
type nfNode struct {
	t        *testing.T
	id       string
	stateDir string
	dir      string
	node     csi.NodeClient
}

func newNFNode(t *testing.T, id string) *nfNode {
	dir := t.TempDir()
	n := &nfNode{t: t, id: id, stateDir: filepath.Join(dir, "state"), dir: dir}
	l := csitest.Listener(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	tr, err := nvmeof.NewTransport(nvmeof.Options{Listener: l, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Config{
		NodeID: id, StateDir: n.stateDir, Logger: logger, Listener: l,
		Transports: []agent.Transport{agent.TransportFunc(agent.TransportKind{Name: nvmeof.Name, Keys: nvmeof.TransportKeys()}, tr.Parse)},
		Takeover:   []agent.TakeoverAuthority{agent.NewOperatorAuthority(n.stateDir)},
	})
	if err != nil {
		t.Fatal(err)
	}
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	lis, err := agent.Listen(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx, lis) }()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	n.node = csi.NewNodeClient(conn)
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { conn.Close(); cancel(); <-done }) })
	return n
}

type nfVol struct {
	id, staging, target string
	vctx                map[string]string
}

func (n *nfNode) vol(id string) *nfVol {
	v := &nfVol{id: id, staging: filepath.Join(n.dir, id, "staging"), target: filepath.Join(n.dir, id, "pod", "dev"),
		vctx: map[string]string{nvmeof.KeyTrAddr: os.Getenv("BERTH_FENCE_TRADDR"), nvmeof.KeyTrSvcID: "4420", nvmeof.KeyNQN: nfNQN, nvmeof.KeyNSID: "1"}}
	os.MkdirAll(v.staging, 0o750)
	os.MkdirAll(filepath.Dir(v.target), 0o750)
	return v
}

func (n *nfNode) stage(v *nfVol, extra map[string]string) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	vctx := map[string]string{}
	for k, val := range v.vctx {
		vctx[k] = val
	}
	for k, val := range extra {
		vctx[k] = val
	}
	start := time.Now()
	_, err := n.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: csitest.BlockCap(), VolumeContext: vctx})
	return time.Since(start), err
}

func (n *nfNode) mustStage(v *nfVol) time.Duration {
	n.t.Helper()
	d, err := n.stage(v, nil)
	if err != nil {
		n.t.Errorf("%s: NodeStageVolume %s: %v", n.id, v.id, err)
	}
	return d
}

func (n *nfNode) publish(v *nfVol) {
	n.t.Helper()
	os.WriteFile(v.target, nil, 0o600)
	if _, err := n.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		TargetPath: v.target, VolumeCapability: csitest.BlockCap(), VolumeContext: v.vctx}); err != nil {
		n.t.Errorf("%s: NodePublishVolume %s: %v", n.id, v.id, err)
	}
}

func (n *nfNode) mustUnstage(v *nfVol) {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := n.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
		n.t.Errorf("%s: NodeUnpublishVolume %s: %v", n.id, v.id, err)
	}
	if _, err := n.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
		n.t.Errorf("%s: NodeUnstageVolume %s: %v", n.id, v.id, err)
	}
}

func (n *nfNode) condition(v *nfVol) *csi.VolumeCondition {
	resp, err := n.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.staging})
	if err != nil {
		n.t.Errorf("%s: NodeGetVolumeStats %s: %v", n.id, v.id, err)
		return nil
	}
	return resp.GetVolumeCondition()
}

// nfWriter writes records of node id through dev, one 4 KiB block at a
// time with O_DIRECT and O_DSYNC, cycling through the region, until
// halted. It counts the writes that succeeded and failed.
type nfWriter struct {
	ok, failed atomic.Int64
	lastErr    atomic.Value
	stop, done chan struct{}
}

func startNFWriter(t *testing.T, dev, id string) *nfWriter {
	f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT|unix.O_DSYNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	w := &nfWriter{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		defer f.Close()
		buf := nfAligned(nfRecSize)
		for seq := 0; ; seq++ {
			select {
			case <-w.stop:
				return
			default:
			}
			copy(buf, fmt.Sprintf("FENCE-REC %s seq=%d\n", id, seq))
			if _, err := f.WriteAt(buf, int64(seq%nfRegion)*nfRecSize); err != nil {
				w.failed.Add(1)
				w.lastErr.Store(err.Error())
				time.Sleep(50 * time.Millisecond)
				continue
			}
			w.ok.Add(1)
		}
	}()
	return w
}

func (w *nfWriter) halt() { close(w.stop); <-w.done }

// nfRegister sends IOC_PR_REGISTER (linux/pr.h: _IOW('p', 200, struct
// pr_registration)) through dev.
func nfRegister(t *testing.T, dev string, old, new uint64) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	reg := struct {
		old, new uint64
		flags, _ uint32
	}{old: old, new: new}
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), 0x401870c8, uintptr(unsafe.Pointer(&reg)))
	if errno != 0 || r != 0 {
		t.Fatalf("IOC_PR_REGISTER %#x -> %#x: result %#x, errno %v", old, new, r, errno)
	}
}

func nfSteps(t *testing.T, steps []fenceStepNF) {
	for i, s := range steps {
		name := fmt.Sprintf("%d-%s", i, s.name)
		vm.WaitHost(t, name)
		s.fn()
		vm.SignalHost(name + "-done")
	}
	vm.WaitHost(t, "stop")
}

type fenceStepNF struct {
	name string
	fn   func()
}

func TestNVMeFenceGuestNodeA(t *testing.T) {
	vm.RequireGuest(t)
	n := newNFNode(t, "node-a")
	blk := n.vol("vol-blk")
	var w *nfWriter
	vm.SignalHost("ready")
	nfSteps(t, []fenceStepNF{
		{"stage-blk", func() {
			d := n.mustStage(blk)
			t.Logf("node-a: staged vol-blk in %v", d.Round(time.Millisecond))
			n.publish(blk)
			w = startNFWriter(t, blk.target, "node-a")
			for w.ok.Load() < 20 && w.failed.Load() == 0 {
				time.Sleep(20 * time.Millisecond)
			}
			if w.failed.Load() != 0 {
				t.Errorf("node-a: the holder's writes fail: %v", w.lastErr.Load())
			}
		}},
		{"resumed", func() {
			// The guest was frozen and goes on here, against a target
			// that fenced it; its controller may reconnect first (the
			// target's keep-alive timer ran out while it was frozen).
			// A write the target completed before the preempt may be
			// seen complete only now: the oracle shows none outlived
			// the fence.
			deadline := time.Now().Add(90 * time.Second)
			for w.failed.Load() == 0 && time.Now().Before(deadline) {
				time.Sleep(100 * time.Millisecond)
			}
			time.Sleep(time.Second)
			before := w.ok.Load()
			time.Sleep(5 * time.Second)
			w.halt()
			after := w.ok.Load() - before
			t.Logf("node-a after the takeover: %d writes succeeded, %d failed (last: %v)", after, w.failed.Load(), w.lastErr.Load())
			if after != 0 || w.failed.Load() == 0 {
				t.Errorf("node-a: %d writes succeeded after it was fenced, %d failed; want none and some", after, w.failed.Load())
			}
		}},
		{"unstage-fenced", func() {
			// The controller may be reconnecting still (the target's
			// keep-alive timer ran out while the guest was frozen):
			// without a live path the reservation cannot be read.
			c := n.condition(blk)
			for deadline := time.Now().Add(60 * time.Second); (c == nil || !c.Abnormal) && time.Now().Before(deadline); c = n.condition(blk) {
				time.Sleep(500 * time.Millisecond)
			}
			t.Logf("node-a's condition: %+v", c)
			if c == nil || !c.Abnormal || !strings.Contains(c.Message, "preempted") {
				t.Errorf("node-a: condition %+v, want abnormal: preempted", c)
			}
			if _, err := n.stage(blk, nil); status.Code(err) != codes.FailedPrecondition {
				t.Errorf("node-a: a repeated stage on the preempted node: %v, want FailedPrecondition", err)
			} else {
				t.Logf("node-a: repeated stage refused: %v", err)
			}
			n.mustUnstage(blk)
		}},
		{"stage-back", func() {
			d := n.mustStage(blk)
			t.Logf("node-a: staged vol-blk back in %v (no takeover)", d.Round(time.Millisecond))
		}},
		{"unstage-blk", func() { n.mustUnstage(blk) }},
		{"key-zero", func() {
			// Unfenced, so that berth registers nothing; then the
			// kernel's register to key 0, as a tool or an older
			// unregister would send it.
			if _, err := n.stage(blk, map[string]string{"fencing": "none"}); err != nil {
				t.Fatalf("stage unfenced: %v", err)
			}
			n.publish(blk)
			nfRegister(t, blk.target, 0, 0x5eed)
			nfRegister(t, blk.target, 0x5eed, 0)
			n.mustUnstage(blk)
		}},
		{"stage-reclaim", func() {
			d := n.mustStage(blk)
			t.Logf("node-a: staged vol-blk from the key-0 registration in %v", d.Round(time.Millisecond))
		}},
		{"unstage-blk", func() { n.mustUnstage(blk) }},
		{"timings", func() {
			for _, fencing := range []string{"reservation", "none"} {
				var ds []string
				for range 3 {
					d, err := n.stage(blk, map[string]string{"fencing": fencing})
					if err != nil {
						t.Errorf("stage with fencing %s: %v", fencing, err)
					}
					ds = append(ds, d.Round(time.Millisecond).String())
					if c := n.condition(blk); fencing == "none" && (c == nil || !strings.Contains(c.Message, "unfenced")) {
						t.Errorf("an unfenced volume's condition: %+v", c)
					}
					n.mustUnstage(blk)
				}
				t.Logf("stage times, fencing %s: %s", fencing, strings.Join(ds, " "))
			}
		}},
	})
}

func TestNVMeFenceGuestNodeB(t *testing.T) {
	vm.RequireGuest(t)
	n := newNFNode(t, "node-b")
	blk := n.vol("vol-blk")
	vm.SignalHost("ready")
	nfSteps(t, []fenceStepNF{
		{"stage-blk-refused", func() {
			_, err := n.stage(blk, nil)
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), fmt.Sprintf("%#016x", agent.NodeKey("node-a"))) {
				t.Errorf("node-b: unauthorised stage of vol-blk: %v, want FailedPrecondition naming node-a's key", err)
			} else {
				t.Logf("node-b refused: %v", err)
			}
		}},
		{"takeover-blk", func() {
			out, err := exec.Command("berth", "takeover", "--state-dir", n.stateDir, "--volume-id", blk.id, "--from-node", "node-a").CombinedOutput()
			if err != nil {
				t.Fatalf("berth takeover: %v: %s", err, out)
			}
			t.Logf("berth takeover: %s", bytes.TrimSpace(out))
			d := n.mustStage(blk)
			t.Logf("node-b: takeover stage of vol-blk in %v", d.Round(time.Millisecond))
			n.publish(blk)
			f, err := os.OpenFile(blk.target, os.O_WRONLY|unix.O_DIRECT|unix.O_DSYNC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			buf := nfAligned(nfRegion * nfRecSize)
			for i := range nfRegion {
				copy(buf[i*nfRecSize:], fmt.Sprintf("FENCE-MARK node-b block=%d\n", i))
			}
			if _, err := f.WriteAt(buf, 0); err != nil {
				t.Errorf("node-b: write the fence markers: %v", err)
			}
		}},
		{"unstage-blk", func() { n.mustUnstage(blk) }},
	})
}
