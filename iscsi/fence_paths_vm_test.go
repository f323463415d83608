package iscsi_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm/target"
)

// The fencing cases about paths and I_T nexuses (issue 30's cases 8 to
// 10), steps of TestVMFencing: a session logged out and in again with a
// new ISID (relogin), the target restarted (restart), and a volume with
// two paths on each node (multipath).

// fenceProbeAt is where a probe write lands on LUN 1: past the record
// region, so that it changes nothing the oracle reads.
const fenceProbeAt = 8 << 20

// fencePathSteps are a node guest's steps of these cases (node-b also
// runs its stage-blk-refused in them).
func fencePathSteps(t *testing.T, n *fenceNode) map[string]func() {
	blk := n.vol("vol-blk", "1", csitest.BlockCap())
	mp := n.vol("vol-mp", "2", csitest.BlockCap())
	ip, _, _ := strings.Cut(os.Getenv("BERTH_FENCE_PORTAL"), ":")
	delete(mp.vctx, "targetPortal")
	mp.vctx["portals"] = fmt.Sprintf(`["%s:3260","%s:3261"]`, ip, ip)
	// A path that fails fails over within seconds, not open-iscsi's 120.
	mp.vctx[iscsi.ParamReplacementTimeout] = "5"
	var w *fenceWriter
	if n.id == "node-b" {
		return map[string]func(){
			"mp-takeover": func() {
				out, err := exec.Command("berth", "takeover", "--state-dir", n.stateDir, "--volume-id", mp.id, "--from-node", "node-a").CombinedOutput()
				if err != nil {
					t.Fatalf("berth takeover: %v: %s", err, out)
				}
				d := n.mustStage(mp)
				n.publish(mp)
				t.Logf("node-b: takeover stage of vol-mp in %v over %s", d.Round(time.Millisecond), mapPaths(t, mp.target))
				writeMarkers(t, mp.target, "node-b")
			},
			"mp-writer": func() {
				w = startFenceWriter(t, mp.target, "node-b", fenceProbeAt)
				for w.ok.Load() < 20 && w.failed.Load() == 0 {
					time.Sleep(20 * time.Millisecond)
				}
				if w.failed.Load() != 0 {
					t.Errorf("node-b: the holder's writes fail: %v", w.lastErr.Load())
				}
			},
			"mp-one-path": func() {
				// The target took the holding path away: the map sees it
				// fail once the session's replacement timeout passed.
				start := time.Now()
				for !strings.Contains(mapStatus(t, mp.target), " F ") {
					if time.Since(start) > 2*time.Minute {
						t.Fatalf("node-b: no path of the map failed within 2 minutes: %s", mapStatus(t, mp.target))
					}
					time.Sleep(200 * time.Millisecond)
				}
				failedAt, before := time.Since(start), w.ok.Load()
				time.Sleep(5 * time.Second)
				t.Logf("node-b: a path failed after %v (%s); %d writes in the 5 s after, %d failed in all, longest stall %v",
					failedAt.Round(time.Millisecond), mapStatus(t, mp.target), w.ok.Load()-before, w.failed.Load(), time.Duration(w.maxGap.Load()).Round(time.Millisecond))
				if w.ok.Load() == before || w.failed.Load() != 0 {
					t.Errorf("node-b: with one path left, %d writes succeeded and %d failed (last: %v); want writes to go on, none failing",
						w.ok.Load()-before, w.failed.Load(), w.lastErr.Load())
				}
			},
			"mp-unstage": func() {
				// The path back (its session logged in again, multipathd
				// reinstated it) before the unstage.
				start := time.Now()
				for strings.Contains(mapStatus(t, mp.target), " F ") && time.Since(start) < 2*time.Minute {
					time.Sleep(200 * time.Millisecond)
				}
				w.halt()
				t.Logf("node-b: the path back after %v (%s); %d writes, %d failed, longest stall %v", time.Since(start).Round(time.Millisecond),
					mapStatus(t, mp.target), w.ok.Load(), w.failed.Load(), time.Duration(w.maxGap.Load()).Round(time.Millisecond))
				if w.failed.Load() != 0 {
					t.Errorf("node-b: %d writes failed (last: %v)", w.failed.Load(), w.lastErr.Load())
				}
				n.unstageRetried(mp)
			},
		}
	}
	return map[string]func(){
		"relogin-stage": func() {
			d := n.mustStage(blk)
			dev := lunDisk(t, 1)
			t.Logf("node-a: staged vol-blk in %v on %s; sessions: %s", d.Round(time.Millisecond), dev, sessionStates())
			if err := probeWrite(dev, "node-a"); err != nil {
				t.Errorf("node-a: the holder's write through %s: %v", dev, err)
			}
		},
		"relogin": func() {
			old, before := lunDisk(t, 1), sessionStates()
			portal := os.Getenv("BERTH_FENCE_PORTAL")
			start := time.Now()
			iscsiadm(t, "-m", "node", "-T", fenceIQN, "-p", portal, "-u")
			iscsiadm(t, "-m", "node", "-T", fenceIQN, "-p", portal, "-l")
			took := time.Since(start)
			// berth's node records scan no LUN by themselves.
			dev := scanLUN(t, 1)
			t.Logf("node-a: logged out and in again by hand in %v: %s (%s) is now %s (%s)", took.Round(time.Millisecond), old, before, dev, sessionStates())
			// SPC would refuse the new, unregistered nexus's write with a
			// reservation conflict. LIO lets it through: it tells the
			// holder's nexus from the other nexuses of the holder's
			// initiator (ACL) by the first 8 characters of the ISID's hex
			// string only (get_unaligned_be64 over "00023d000001"), and
			// open-iscsi's ISIDs of one initiator differ in the last
			// ones. Either way only this node, the holder, writes.
			err := probeWrite(dev, "node-a")
			t.Logf("node-a: a write through the new nexus before any stage: %v", err)
			if err != nil && !errors.Is(err, unix.EBADE) {
				t.Errorf("node-a: a write through the new, unregistered nexus: %v, want success (LIO) or a reservation conflict (EBADE)", err)
			}
		},
		"relogin-restage": func() {
			d := n.mustStage(blk)
			dev := lunDisk(t, 1)
			err := probeWrite(dev, "node-a")
			t.Logf("node-a: repeated stage of vol-blk in %v on %s; a write through the new nexus after it: %v", d.Round(time.Millisecond), dev, err)
			if err != nil {
				t.Errorf("node-a: after the repeated stage, a write through the new nexus: %v, want it to succeed", err)
			}
		},
		"restart-target-stage": func() {
			d := n.mustStage(blk)
			dev := lunDisk(t, 1)
			t.Logf("node-a: staged vol-blk in %v on %s; sessions: %s", d.Round(time.Millisecond), dev, sessionStates())
			if err := probeWrite(dev, "node-a"); err != nil {
				t.Errorf("node-a: the holder's write through %s: %v", dev, err)
			}
		},
		"restart-target-write": func() {
			// The session comes back by itself (iSCSI session recovery,
			// same ISID); the write waits for it in the kernel.
			start := time.Now()
			var err error
			tries := 0
			for {
				tries++
				if err = probeWrite(lunDisk(t, 1), "node-a"); err == nil || errors.Is(err, unix.EBADE) || time.Since(start) > 2*time.Minute {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			t.Logf("node-a: after the target's restart, a write through its session: %v after %v (%d tries); sessions: %s", err, time.Since(start).Round(time.Millisecond), tries, sessionStates())
			if err != nil {
				t.Errorf("node-a: the holder's write after the target's restart: %v", err)
			}
		},
		"mp-stage": func() {
			d := n.mustStage(mp)
			n.publish(mp)
			t.Logf("node-a: staged vol-mp in %v over %s", d.Round(time.Millisecond), mapPaths(t, mp.target))
			w = startFenceWriter(t, mp.target, "node-a", 0)
			for w.ok.Load() < 20 && w.failed.Load() == 0 {
				time.Sleep(20 * time.Millisecond)
			}
			if w.failed.Load() != 0 {
				t.Errorf("node-a: the holder's writes fail: %v", w.lastErr.Load())
			}
		},
		"mp-resumed": func() {
			time.Sleep(2 * time.Second)
			before := w.ok.Load()
			time.Sleep(5 * time.Second)
			w.halt()
			after := w.ok.Load() - before
			t.Logf("node-a after the takeover of vol-mp: %d writes succeeded, %d failed (last: %v); %s", after, w.failed.Load(), w.lastErr.Load(), mapStatus(t, mp.target))
			if after != 0 || w.failed.Load() == 0 {
				t.Errorf("node-a: %d writes succeeded after it was fenced, %d failed; want none and some", after, w.failed.Load())
			}
		},
		"mp-unstage-fenced": func() {
			if c := n.condition(mp); c == nil || !c.Abnormal || !strings.Contains(c.Message, "preempted") {
				t.Errorf("node-a: condition %+v, want abnormal: preempted", c)
			}
			n.unstageRetried(mp)
		},
	}
}

// fencePathChecks are the target's checks of these cases.
func fencePathChecks(t *testing.T, x *target.ISCSITarget) map[string]func() {
	var isid, failed string
	return map[string]func(){
		"relogin-before": func() {
			fenceHolds(t, x, 1, fenceIQNA, fenceIQNB, 1)
			isid = holderISID(x, 1, fenceIQNA)
			t.Logf("node-a's session: %s", x.SessionInfo(fenceListen, fenceIQNA))
		},
		"relogin-new-nexus": func() {
			live := sessionISID(x.SessionInfo(fenceListen, fenceIQNA))
			regs := registeredISIDs(x, 1, fenceIQNA)
			t.Logf("node-a: its session's ISID %s, registered %v, holder %s", live, regs, holderISID(x, 1, fenceIQNA))
			if live == "" || live == isid || len(regs) != 1 || regs[0] != isid || holderISID(x, 1, fenceIQNA) != isid {
				t.Errorf("after the relogin, want node-a's new ISID (%q) apart from its registration and reservation's (%q): registered %v, %s",
					live, isid, regs, fencePR(x, 1))
			}
		},
		"relogin-registered": func() {
			live := sessionISID(x.SessionInfo(fenceListen, fenceIQNA))
			regs := registeredISIDs(x, 1, fenceIQNA)
			h := holderISID(x, 1, fenceIQNA)
			t.Logf("node-a: its session's ISID %s, registered %v, holder %s", live, regs, h)
			if len(regs) != 1 || regs[0] != live || h != live {
				t.Errorf("after the repeated stage, want node-a registered and holding through its session's nexus (ISID %s) only: registered %v, holder %s",
					live, regs, h)
			}
		},
		"aptpl": func() {
			fenceHolds(t, x, 1, fenceIQNA, fenceIQNB, 1)
			b, err := os.ReadFile(x.APTPLFile(1))
			t.Logf("%s: %q, %v", x.APTPLFile(1), bytes.TrimRight(b, "\x00"), err)
			if key := fmt.Sprintf("sa_res_key=%d\n", agent.NodeKey("node-a")); !bytes.Contains(b, []byte(key)) || !bytes.Contains(b, []byte("res_holder=1\n")) {
				t.Errorf("LIO saved no APTPL state of node-a's reservation (want %q and res_holder=1): %q, %v", key, b, err)
			}
			isid = holderISID(x, 1, fenceIQNA)
		},
		"restart-target": func() {
			start := time.Now()
			x.Restart()
			t.Logf("the target restarted in %v: %s", time.Since(start).Round(time.Millisecond), fencePR(x, 1))
			fenceHolds(t, x, 1, fenceIQNA, fenceIQNB, 1)
			if h := holderISID(x, 1, fenceIQNA); h != isid {
				t.Errorf("after the restart, node-a holds through ISID %q, want %q as before", h, isid)
			}
		},
		"mp-a-holds": func() { fenceHolds(t, x, 2, fenceIQNA, fenceIQNB, 2) },
		"mp-b-holds": func() { fenceHolds(t, x, 2, fenceIQNB, fenceIQNA, 2) },
		"mp-oracle":  func() { fenceOracle(t, x.BackingDevice(2)) },
		"free-mp":    func() { fenceFree(t, x, 2) },
		"mp-restore-path": func() {
			x.SetPortalEnabled(failed, true)
		},
		"mp-fail-holder-path": func() {
			port := x.PR(2, "res_pr_holder_tg_port")
			m := regexp.MustCompile(`Portal Group Tag: (\d+)`).FindStringSubmatch(port)
			if m == nil {
				t.Fatalf("no holder's TPG in %q", port)
			}
			tag, _ := strconv.Atoi(m[1])
			for _, p := range x.Portals() {
				if x.TPGT(p) == tag {
					failed = p
				}
			}
			t.Logf("the reservation is held through TPG %d (portal %s): disabling it", tag, failed)
			x.SetPortalEnabled(failed, false)
		},
	}
}

var isidRE = regexp.MustCompile(`,i,0x([0-9a-f]+)`)

// registeredISIDs are the ISIDs of iqn's registrations on LUN lun.
func registeredISIDs(x *target.ISCSITarget, lun int, iqn string) []string {
	var out []string
	for _, l := range strings.Split(x.PR(lun, "res_pr_registered_i_pts"), "\n") {
		if m := isidRE.FindStringSubmatch(l); m != nil && strings.Contains(l, iqn+",") {
			out = append(out, m[1])
		}
	}
	return out
}

// holderISID is the ISID of the reservation holder's nexus when iqn holds
// LUN lun, "" otherwise.
func holderISID(x *target.ISCSITarget, lun int, iqn string) string {
	h := x.PR(lun, "res_holder")
	if m := isidRE.FindStringSubmatch(h); m != nil && strings.Contains(h, iqn+",") {
		return m[1]
	}
	return ""
}

// sessionISID is the ISID in LIO's session info ("ISID: 0x00 02 3d ..."),
// in the form the registrations show.
func sessionISID(info string) string {
	m := regexp.MustCompile(`ISID: 0x([0-9a-f ]+?)\s\s`).FindStringSubmatch(info)
	if m == nil {
		return ""
	}
	return strings.ReplaceAll(m[1], " ", "")
}

// probeWrite writes one block of node id through dev at fenceProbeAt,
// with O_DIRECT and O_DSYNC: its error is the target's answer.
func probeWrite(dev, id string) error {
	f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT|unix.O_DSYNC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := alignedBlock(fenceRecSize)
	copy(buf, "FENCE-PROBE "+id+"\n")
	_, err = f.WriteAt(buf, fenceProbeAt)
	return err
}

// lunDisks lists this node's disks of LUN lun, one per iSCSI session that
// has it scanned in.
func lunDisks(t *testing.T, lun int) []string {
	ms, err := filepath.Glob(fmt.Sprintf("/sys/class/iscsi_session/session*/device/target*/*:*:*:%d/block/*", lun))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range ms {
		out = append(out, "/dev/"+filepath.Base(m))
	}
	return out
}

// lunDisk is this node's only disk of LUN lun.
func lunDisk(t *testing.T, lun int) string {
	t.Helper()
	ds := lunDisks(t, lun)
	if len(ds) != 1 {
		t.Fatalf("want one disk of LUN %d, have %v (sessions: %s)", lun, ds, sessionStates())
	}
	return ds[0]
}

// scanLUN scans LUN lun in on every iSCSI host and waits for its disk.
func scanLUN(t *testing.T, lun int) string {
	t.Helper()
	hosts, _ := filepath.Glob("/sys/class/iscsi_host/host*")
	for _, h := range hosts {
		if err := os.WriteFile(filepath.Join("/sys/class/scsi_host", filepath.Base(h), "scan"), []byte(fmt.Sprintf("- - %d", lun)), 0); err != nil {
			t.Fatalf("scan LUN %d on %s: %v", lun, filepath.Base(h), err)
		}
	}
	for start := time.Now(); time.Since(start) < 30*time.Second; time.Sleep(100 * time.Millisecond) {
		if ds := lunDisks(t, lun); len(ds) == 1 {
			if _, err := os.Stat(ds[0]); err == nil {
				return ds[0]
			}
		}
	}
	t.Fatalf("no disk of LUN %d after the scan: %v", lun, lunDisks(t, lun))
	return ""
}

// sessionStates describes this node's iSCSI sessions: their number and
// state (the kernel does not show their ISIDs; LIO's session info does).
func sessionStates() string {
	dirs, _ := filepath.Glob("/sys/class/iscsi_session/session*")
	var out []string
	for _, d := range dirs {
		attr := func(name string) string {
			b, err := os.ReadFile(filepath.Join(d, name))
			if err != nil {
				return "?"
			}
			return strings.TrimSpace(string(b))
		}
		out = append(out, filepath.Base(d)+" "+attr("state"))
	}
	return strings.Join(out, "; ")
}

// unstageRetried unstages v as the kubelet does, again after a refusal
// that asks for a retry (Aborted, Unavailable), up to 5 times; each
// refusal is logged.
func (n *fenceNode) unstageRetried(v *fenceVol) {
	n.t.Helper()
	for i := 1; ; i++ {
		err := n.unstage(v)
		if c := status.Code(err); err == nil || i == 5 || (c != codes.Aborted && c != codes.Unavailable) {
			if err != nil {
				n.t.Errorf("%s: unstage %s (attempt %d): %v", n.id, v.id, i, err)
			}
			return
		}
		n.t.Logf("%s: unstage %s refused (attempt %d), retried in 2 s as the kubelet would: %v", n.id, v.id, i, err)
		time.Sleep(2 * time.Second)
	}
}

func iscsiadm(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("iscsiadm", args...).CombinedOutput(); err != nil {
		t.Fatalf("iscsiadm %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// mapOf is the dm-multipath map a published raw block target is.
func mapOf(t *testing.T, target string) string {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/dm/name", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	if err != nil {
		t.Fatalf("%s is no device-mapper device: %v", target, err)
	}
	return strings.TrimSpace(string(b))
}

// mapPaths names the map behind target and its paths.
func mapPaths(t *testing.T, target string) string {
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(fmt.Sprintf("/sys/dev/block/%d:%d/slaves", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	var paths []string
	for _, e := range ents {
		paths = append(paths, e.Name())
	}
	return fmt.Sprintf("map %s (paths %s)", mapOf(t, target), strings.Join(paths, ", "))
}

// mapStatus is the map's status line (dmsetup status): each path's state
// is A (active) or F (failed).
func mapStatus(t *testing.T, target string) string {
	name := mapOf(t, target)
	out, err := exec.Command("dmsetup", "status", name).CombinedOutput()
	if err != nil {
		t.Fatalf("dmsetup status %s: %v: %s", name, err, out)
	}
	return strings.TrimSpace(string(out))
}
