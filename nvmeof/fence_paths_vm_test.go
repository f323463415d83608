package nvmeof_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm/target"
)

// Issue 30's case 8 over NVMe/TCP, steps of TestVMNVMeFencing: a volume
// reached through two ports of the target, two controllers under one
// native-multipath head on each node. nvmet keeps one registrant per
// host ID, whichever controllers the host has: a node registers once and
// writes through every controller; a preempt removes it from all of them.

// nfPathSteps are a node guest's steps of case 8.
func nfPathSteps(t *testing.T, n *nfNode) map[string]func() {
	mp := n.vol("vol-mp", nfMPNQN, csitest.BlockCap())
	ip := mp.vctx[nvmeof.KeyTrAddr]
	delete(mp.vctx, nvmeof.KeyTrAddr)
	delete(mp.vctx, nvmeof.KeyTrSvcID)
	mp.vctx[nvmeof.KeyTargets] = ip + ":4420," + ip + ":" + nfPort2
	// A controller whose port comes back reconnects within a second.
	mp.vctx[nvmeof.KeyReconnectDelay] = "1"
	var w *nfWriter
	if n.id == "node-b" {
		return map[string]func(){
			"mp-takeover": func() {
				d := n.takeover(mp)
				t.Logf("node-b: takeover stage of vol-mp in %v over %s", d.Round(time.Millisecond), nfMPPaths(t, mp.target))
				nfMarkers(t, mp.target, "node-b")
			},
			"mp-writer": func() {
				// Round-robin: both paths carry the writes, so that the
				// one the target drops had some in flight.
				nfWaitPaths(t, mp.target, 2)
				head := nfHead(t, mp.target)
				nfSetIOPolicy(t, head, "round-robin")
				w = startNFWriter(t, mp.target, "node-b", nfProbeAt)
				w.started(t, "node-b")
				before := nfPathWrites(t, head)
				time.Sleep(2 * time.Second)
				paths := nfPathWrites(t, head)
				t.Logf("node-b: write requests completed by path in 2 s: %v (%s)", nfDelta(before, paths), nfMPPaths(t, mp.target))
				for p, c := range paths {
					if c == before[p] {
						t.Errorf("node-b: no write went through path %s: %v", p, nfDelta(before, paths))
					}
				}
			},
			"mp-one-path": func() {
				// The target dropped a port: one controller stops being
				// live (it tries to reconnect).
				head := nfHead(t, mp.target)
				start := time.Now()
				for nfLive(t, nfMPNQN) != 1 {
					if time.Since(start) > time.Minute {
						t.Fatalf("node-b: no controller went down within a minute: %s", nfMPPaths(t, mp.target))
					}
					time.Sleep(100 * time.Millisecond)
				}
				downAt, ok, failed, at := time.Since(start), w.ok.Load(), w.failed.Load(), nfPathWrites(t, head)
				time.Sleep(5 * time.Second)
				now := nfPathWrites(t, head)
				t.Logf("node-b: a path went down after %v (%s); in the 5 s after, %d writes (write requests by path: %v), %d failed; in all %d failed, longest stall %v",
					downAt.Round(time.Millisecond), nfMPPaths(t, mp.target), w.ok.Load()-ok, nfDelta(at, now), w.failed.Load()-failed,
					w.failed.Load(), time.Duration(w.maxGap.Load()).Round(time.Millisecond))
				if w.ok.Load() == ok || w.failed.Load() != 0 {
					t.Errorf("node-b: with one path left, %d writes succeeded and %d failed (last: %v); want writes to go on, none failing",
						w.ok.Load()-ok, w.failed.Load(), w.lastErr.Load())
				}
			},
			"mp-unstage": func() {
				// The port back, its controller reconnected, before the
				// unstage.
				nfWaitPaths(t, mp.target, 2)
				w.halt()
				t.Logf("node-b: %d writes, %d failed, longest stall %v", w.ok.Load(), w.failed.Load(), time.Duration(w.maxGap.Load()).Round(time.Millisecond))
				if w.failed.Load() != 0 {
					t.Errorf("node-b: %d writes failed (last: %v)", w.failed.Load(), w.lastErr.Load())
				}
				n.unstageRetried(mp)
			},
		}
	}
	return map[string]func(){
		"mp-stage": func() {
			d := n.mustStage(mp)
			n.publish(mp)
			nfWaitPaths(t, mp.target, 2)
			t.Logf("node-a: staged vol-mp in %v over %s", d.Round(time.Millisecond), nfMPPaths(t, mp.target))
			// Each controller writes: the node is registered for both.
			for _, c := range nfControllers(t, nfMPNQN) {
				st, err := nfControllerWrite(t, c, mp.target, "node-a")
				t.Logf("node-a: a write through %s alone: status %#x, %v", c, st, err)
				if st != 0 || err != nil {
					t.Errorf("node-a: the holder's write through controller %s: status %#x, %v", c, st, err)
				}
			}
			w = startNFWriter(t, mp.target, "node-a", 0)
			w.started(t, "node-a")
		},
		"mp-resumed": func() {
			w.fenced(t, "node-a")
			// Both controllers live (again, if the target dropped them
			// while the guest was frozen), and each refused.
			nfWaitPaths(t, mp.target, 2)
			ctrls := nfControllers(t, nfMPNQN)
			if len(ctrls) != 2 {
				t.Errorf("node-a: controllers of %s: %v, want two", nfMPNQN, ctrls)
			}
			for _, c := range ctrls {
				st, err := nfControllerWrite(t, c, mp.target, "node-a")
				t.Logf("node-a: after the takeover, a write through %s alone: status %#x, %v", c, st, err)
				if st&0x7ff != 0x83 || err != nil {
					t.Errorf("node-a: after the takeover, a write through controller %s: status %#x, %v; want a reservation conflict (0x83)", c, st, err)
				}
			}
		},
		"mp-unstage-fenced": func() {
			n.preempted(mp)
			n.unstageRetried(mp)
		},
	}
}

// nfPathChecks are the target's checks of case 8, x being nfMPNQN's
// subsystem and dev the target's own head of it.
func nfPathChecks(t *testing.T, x *target.NVMeTarget, dev string) map[string]func() {
	port := "0.0.0.0:" + nfPort2
	return map[string]func(){
		"mp-a-holds": func() { nfHolds(t, dev, "node-a") },
		"mp-b-holds": func() { nfHolds(t, dev, "node-b") },
		"mp-oracle":  func() { nfOracle(t, x.BackingDevice(1)) },
		"mp-free":    func() { nfFree(t, dev) },
		"mp-fail-path": func() {
			t.Logf("dropping port %s of %s (ports %v)", port, x.NQN(), x.Ports())
			x.RemovePort(port)
		},
		"mp-restore-path": func() { x.AddPort(port) },
	}
}

// nfHead is the namespace head (nvmeXnY) a published raw block target
// is.
func nfHead(t *testing.T, target string) string {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		t.Fatal(err)
	}
	p, err := filepath.EvalSymlinks(fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Base(p)
}

// nfPaths are the path devices (nvmeXcZnY) under head.
func nfPaths(t *testing.T, head string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join("/sys/block", head, "multipath"))
	if err != nil {
		t.Fatalf("%s is no native-multipath head: %v", head, err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// nfPathWrites counts the write requests each path of head completed
// (the path device's stat).
func nfPathWrites(t *testing.T, head string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, p := range nfPaths(t, head) {
		b, err := os.ReadFile(filepath.Join("/sys/block", head, "multipath", p, "stat"))
		f := strings.Fields(string(b))
		if err != nil || len(f) < 5 {
			t.Errorf("the writes of path %s: %q, %v", p, b, err)
			continue
		}
		out[p], _ = strconv.ParseInt(f[4], 10, 64)
	}
	return out
}

func nfDelta(before, after map[string]int64) map[string]int64 {
	d := map[string]int64{}
	for p, c := range after {
		d[p] = c - before[p]
	}
	return d
}

// nfSetIOPolicy sets the I/O policy of head's subsystem.
func nfSetIOPolicy(t *testing.T, head, policy string) {
	t.Helper()
	subsys, err := filepath.EvalSymlinks(filepath.Join("/sys/block", head, "device"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(subsys, "iopolicy"), []byte(policy), 0); err != nil {
		t.Fatalf("iopolicy of %s: %v", subsys, err)
	}
}

// nfControllers are this node's controllers (nvmeN) of subsystem nqn.
func nfControllers(t *testing.T, nqn string) []string {
	t.Helper()
	ms, _ := filepath.Glob("/sys/class/nvme/nvme*")
	var out []string
	for _, m := range ms {
		if b, err := os.ReadFile(filepath.Join(m, "subsysnqn")); err == nil && strings.TrimSpace(string(b)) == nqn {
			out = append(out, filepath.Base(m))
		}
	}
	slices.Sort(out)
	return out
}

// nfLive counts this node's live controllers of subsystem nqn.
func nfLive(t *testing.T, nqn string) int {
	n := 0
	for _, c := range nfControllers(t, nqn) {
		if nfAttr(filepath.Join("/sys/class/nvme", c), "state") == "live" {
			n++
		}
	}
	return n
}

// nfWaitPaths waits up to a minute for n live controllers of nfMPNQN
// and n paths under the head behind target: a controller's path to the
// namespace appears once its namespace scan ran, after it went live
// (and after a stage that needed one path).
func nfWaitPaths(t *testing.T, target string, n int) {
	t.Helper()
	start := time.Now()
	for nfLive(t, nfMPNQN) != n || len(nfPaths(t, nfHead(t, target))) != n {
		if time.Since(start) > time.Minute {
			t.Errorf("after a minute, want %d live controllers and paths: %s", n, nfMPPaths(t, target))
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("%d controllers and paths of %s after %v", n, nfMPNQN, time.Since(start).Round(time.Millisecond))
}

func nfAttr(dir, name string) string {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}

// nfMPPaths describes the head behind target and its controllers.
func nfMPPaths(t *testing.T, target string) string {
	head := nfHead(t, target)
	var cs []string
	for _, c := range nfControllers(t, nfMPNQN) {
		d := filepath.Join("/sys/class/nvme", c)
		cs = append(cs, fmt.Sprintf("%s %s %s", c, nfAttr(d, "address"), nfAttr(d, "state")))
	}
	return fmt.Sprintf("head %s (paths %s; controllers %s)", head, strings.Join(nfPaths(t, head), ", "), strings.Join(cs, "; "))
}

// nfControllerWrite writes one block of node id at nfProbeAt through
// controller ctrl alone: an NVMe Write passed through its character
// device (the subsystem has one namespace). It returns the NVMe status.
func nfControllerWrite(t *testing.T, ctrl, target, id string) (uint32, error) {
	t.Helper()
	lbs, err := strconv.Atoi(nfAttr(filepath.Join("/sys/block", nfHead(t, target), "queue"), "logical_block_size"))
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile("/dev/"+ctrl, os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := nfAligned(nfRecSize)
	copy(buf, "FENCE-PROBE "+id+" through "+ctrl+"\n")
	slba := uint64(nfProbeAt / lbs)
	cmd := nfPassthru{opcode: 0x01, nsid: 1, cdw10: uint32(slba), cdw11: uint32(slba >> 32), cdw12: uint32(nfRecSize/lbs - 1)}
	return nfIOCmd(f, &cmd, buf)
}
