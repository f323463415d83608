package iscsi_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm/target"
)

// The fencing case of a path that joins a staged volume's map (steps of
// TestVMFencing's group newpath): node-a's session through the second
// portal (TPG 2) is logged out under the staged volume and logged in
// again, a new I_T nexus with another ISID, which multipathd adds to the
// map. berth registers it while node-a holds the volume, and never once
// node-b took the volume over.
//
// Through the first case a write through the new nexus says little: LIO
// keeps the registered state of a LUN per initiator ACL, not per ISID
// (target_nacl_find_deve), and the registration of node-a's first
// session through TPG 2, gone but kept, lets the new session's writes
// through. The target's list of registered nexuses says which are.
// After node-b's preempt no registration of node-a is left, and every
// write of node-a fails, through the new nexus too, unless it was
// registered again.

// fenceNewPathWait bounds how long the target waits for the new nexus's
// registration.
const fenceNewPathWait = 20 * time.Second

// fenceNewPathSteps are node-a's and node-b's steps of the case.
func fenceNewPathSteps(t *testing.T, n *fenceNode) map[string]func() {
	mp := n.vol("vol-mp", "2", csitest.BlockCap())
	ip, _, _ := strings.Cut(os.Getenv("BERTH_FENCE_PORTAL"), ":")
	delete(mp.vctx, "targetPortal")
	second := ip + ":3261"
	mp.vctx["portals"] = fmt.Sprintf(`["%s:3260","%s"]`, ip, second)
	mp.vctx[iscsi.ParamReplacementTimeout] = "5"
	if n.id == "node-b" {
		return map[string]func(){
			"np-unstage": func() { n.unstageRetried(mp) },
		}
	}
	var w *fenceWriter
	return map[string]func(){
		"np-stage": func() {
			d := n.mustStage(mp)
			n.publish(mp)
			t.Logf("node-a: staged vol-mp in %v over %s", d.Round(time.Millisecond), mapPaths(t, mp.target))
			if s := mapSlaves(t, mp.target); len(s) != 2 {
				t.Fatalf("node-a: the map has paths %v, want 2", s)
			}
			w = startFenceWriter(t, mp.target, "node-a", fenceProbeAt)
			for w.ok.Load() < 20 && w.failed.Load() == 0 {
				time.Sleep(20 * time.Millisecond)
			}
			if w.failed.Load() != 0 {
				t.Errorf("node-a: the holder's writes fail: %v", w.lastErr.Load())
			}
		},
		"np-drop-path": func() {
			iscsiadm(t, "-m", "node", "-T", fenceIQN, "-p", second, "-u")
			waitMapPaths(t, mp.target, 1)
			t.Logf("node-a: logged out of %s: %s; sessions: %s", second, mapPaths(t, mp.target), sessionStates())
		},
		"np-add-path": func() {
			took := addSecondPath(t, mp.target, second)
			t.Logf("node-a: logged in to %s again; the new path joined the map after %v: %s", second, took.Round(time.Millisecond), mapPaths(t, mp.target))
		},
		"np-add-path-fenced": func() {
			before := w.ok.Load()
			took := addSecondPath(t, mp.target, second)
			// berth looks at the map on its change event: in the first
			// case it registered the new nexus within about a second.
			time.Sleep(5 * time.Second)
			w.halt()
			after := w.ok.Load() - before
			t.Logf("node-a, preempted: the new path joined the map after %v (%s); %d writes succeeded since, %d failed in all (last: %v)",
				took.Round(time.Millisecond), mapPaths(t, mp.target), after, w.failed.Load(), w.lastErr.Load())
			if after != 0 || w.failed.Load() == 0 {
				t.Errorf("node-a: %d writes succeeded after it was preempted and a new path joined, %d failed; want none and some", after, w.failed.Load())
			}
		},
		"np-unstage": func() {
			w.halt()
			t.Logf("node-a: %d writes, %d failed (last: %v), longest stall %v", w.ok.Load(), w.failed.Load(), w.lastErr.Load(), time.Duration(w.maxGap.Load()).Round(time.Millisecond))
			if w.failed.Load() != 0 {
				t.Errorf("node-a: %d of the holder's writes failed (last: %v)", w.failed.Load(), w.lastErr.Load())
			}
			n.unstageRetried(mp)
		},
	}
}

// addSecondPath logs in to portal again, scans LUN 2 in on the new
// session and waits until the map behind target has two paths; it
// returns how long that took from the login.
func addSecondPath(t *testing.T, target, portal string) time.Duration {
	t.Helper()
	start := time.Now()
	iscsiadm(t, "-m", "node", "-T", fenceIQN, "-p", portal, "-l")
	// berth's node records scan no LUN by themselves.
	hosts, _ := filepath.Glob("/sys/class/iscsi_host/host*")
	for _, h := range hosts {
		if err := os.WriteFile(filepath.Join("/sys/class/scsi_host", filepath.Base(h), "scan"), []byte("- - 2"), 0); err != nil {
			t.Fatalf("scan LUN 2 on %s: %v", filepath.Base(h), err)
		}
	}
	waitMapPaths(t, target, 2)
	return time.Since(start)
}

// mapSlaves are the paths of the map behind a published raw block target.
func mapSlaves(t *testing.T, target string) []string {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(fmt.Sprintf("/sys/dev/block/%d:%d/slaves", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// waitMapPaths waits up to a minute for the map behind target to have n
// paths.
func waitMapPaths(t *testing.T, target string, n int) {
	t.Helper()
	for start := time.Now(); len(mapSlaves(t, target)) != n; time.Sleep(50 * time.Millisecond) {
		if time.Since(start) > time.Minute {
			t.Fatalf("the map has paths %v after a minute, want %d (%s)", mapSlaves(t, target), n, sessionStates())
		}
	}
}

// fenceNewPathChecks are the target's checks of the case.
func fenceNewPathChecks(t *testing.T, x *target.ISCSITarget) map[string]func() {
	return map[string]func(){
		"np-registered": func() {
			start := time.Now()
			var live string
			var regs []string
			for {
				live = sessionISID(x.SessionInfo(fenceListen2, fenceIQNA))
				regs = registeredISIDs(x, 2, fenceIQNA)
				if live != "" && slices.Contains(regs, live) || time.Since(start) > fenceNewPathWait {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Logf("node-a's new session through TPG 2: ISID %s; node-a's registered ISIDs %v after %v", live, regs, time.Since(start).Round(time.Millisecond))
			if live == "" || !slices.Contains(regs, live) {
				t.Errorf("node-a's new nexus (ISID %q) is not registered within %v: %s", live, fenceNewPathWait, fencePR(x, 2))
			}
			if !strings.Contains(x.PR(2, "res_holder"), fenceIQNA) || strings.Contains(x.PR(2, "res_pr_registered_i_pts"), fenceIQNB) {
				t.Errorf("want node-a holding and node-b not registered: %s", fencePR(x, 2))
			}
		},
	}
}
