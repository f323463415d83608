package iscsi_test

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
	"os/exec"
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

	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/reliability"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMISCSIFaults runs the iSCSI fault tests (TestFaultISCSI*) against
// LIO on loopback. Each reports a row of make reliability's fault table.
func TestVMISCSIFaults(t *testing.T) {
	m := vm.RunGuestTests(t,
		vm.WithTestRun(iscsi.GuestRun("^TestFaultISCSI")),
		vm.WithModules("iscsi_tcp", "target_core_mod", "target_core_iblock", "iscsi_target_mod", "loop"),
		vm.WithIscsid(),
		vm.WithTimeout(7*time.Minute))
	reliability.ReportFaults(t, m.Output())
}

// faultVolume is one mount volume driven through the agent's gRPC API.
type faultVolume struct {
	node            csi.NodeClient
	id              string
	vctx            map[string]string
	cap             *csi.VolumeCapability
	staging, target string
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

func (v *faultVolume) stats(ctx context.Context, p string) (*csi.NodeGetVolumeStatsResponse, error) {
	return v.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: p})
}

func (v *faultVolume) expand(ctx context.Context, bytes int64) (*csi.NodeExpandVolumeResponse, error) {
	return v.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target,
		StagingTargetPath: v.staging, VolumeCapability: v.cap, CapacityRange: &csi.CapacityRange{RequiredBytes: bytes}})
}

// cleanup unpublishes and unstages the volume, as a CO that gives up on it.
func (v *faultVolume) cleanup(t *testing.T, ctx context.Context) {
	t.Helper()
	if _, err := v.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
		t.Errorf("NodeUnpublishVolume %s: %v", v.id, err)
	}
	if _, err := v.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
		t.Errorf("NodeUnstageVolume %s: %v", v.id, err)
	}
}

func (v *faultVolume) writeData(t *testing.T) {
	t.Helper()
	payload := make([]byte, 256<<10)
	rand.Read(payload)
	if err := os.WriteFile(filepath.Join(v.target, "data"), payload, 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
}

func isMounted(t *testing.T, p string) bool {
	t.Helper()
	var st, parent unix.Stat_t
	if err := unix.Stat(p, &st); errors.Is(err, unix.ENOENT) {
		return false
	} else if err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Dir(p), &parent); err != nil {
		t.Fatal(err)
	}
	return st.Dev != parent.Dev
}

func unmount(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		if err := unix.Unmount(p, 0); err != nil {
			t.Fatalf("unmount %s: %v", p, err)
		}
	}
}

// firstNonZero is the offset of the first byte of the file that is not
// zero, -1 when it holds only zeros.
func firstNonZero(t *testing.T, name string) int64 {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, zero := make([]byte, 1<<20), make([]byte, 1<<20)
	var off int64
	for {
		n, err := f.Read(buf)
		if n > 0 && !bytes.Equal(buf[:n], zero[:n]) {
			return off + int64(bytes.IndexFunc(buf[:n], func(r rune) bool { return r != 0 }))
		}
		off += int64(n)
		if err == io.EOF {
			return -1
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func wantRefused(t *testing.T, what string, err error) {
	t.Helper()
	switch {
	case err == nil:
		t.Errorf("%s: succeeded on a volume whose LUN was replaced", what)
	case status.Code(err) != codes.FailedPrecondition:
		t.Errorf("%s: %v, want FailedPrecondition", what, err)
	default:
		t.Logf("%s refused: %v", what, err)
	}
}

func wantAbnormal(t *testing.T, what string, resp *csi.NodeGetVolumeStatsResponse, err error) {
	t.Helper()
	switch {
	case err != nil && status.Code(err) == codes.FailedPrecondition:
		t.Logf("%s refused: %v", what, err)
	case err != nil:
		t.Errorf("%s: %v", what, err)
	case !resp.GetVolumeCondition().GetAbnormal():
		t.Errorf("%s: condition %v after the LUN was replaced, want abnormal", what, resp.GetVolumeCondition())
	default:
		t.Logf("%s: abnormal: %s", what, resp.GetVolumeCondition().GetMessage())
	}
}

// TestFaultISCSILUNReplaced: the LUN behind a staged volume is unmapped
// and another backstore (another serial, so another WWID) mapped under the
// same LUN number. The volume_context names the LUN by number only. No
// RPC uses the new LUN as the volume:
//
//   - mounted: NodeExpandVolume, whose rescan is the first to read the new
//     identity, refuses instead of growing the old filesystem into the
//     new LUN; then the stats are abnormal, a repeated stage and a publish
//     refuse;
//   - staging mount lost before the replacement: NodeStageVolume refuses
//     instead of formatting the new, blank LUN.
//
// Nothing berth does writes to the new LUN.
func TestFaultISCSILUNReplaced(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "iSCSI LUN replaced under its number")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 64<<20)
	lt.AddLUN(1, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol := func(id, lun string) *faultVolume {
		return newFaultVolume(t, node, id, map[string]string{"targetPortal": lt.Portal(1), "iqn": lt.IQN, "lun": lun})
	}
	mounted, lost := vol("vol-lun0", "0"), vol("vol-lun1", "1")
	for _, v := range []*faultVolume{mounted, lost} {
		if err := v.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", v.id, err)
		}
		if err := v.publishAt(ctx, v.target); err != nil {
			t.Fatalf("NodePublishVolume %s: %v", v.id, err)
		}
		v.writeData(t)
	}

	t.Run("mounted", func(t *testing.T) {
		defer mounted.cleanup(t, ctx)
		lt.ReplaceLUN(0, 128<<20)
		newLUN := lt.BackingFile(0)
		_, err := mounted.expand(ctx, 128<<20)
		wantRefused(t, "NodeExpandVolume", err)
		resp, err := mounted.stats(ctx, mounted.target)
		wantAbnormal(t, "NodeGetVolumeStats", resp, err)
		wantRefused(t, "repeated NodeStageVolume", mounted.stage(ctx))
		second := filepath.Join(filepath.Dir(mounted.target), "vol2")
		wantRefused(t, "NodePublishVolume at another target", mounted.publishAt(ctx, second))
		if isMounted(t, second) {
			t.Errorf("%s is mounted after a refused publish", second)
			unix.Unmount(second, unix.MNT_DETACH)
		}
		if off := firstNonZero(t, newLUN); off >= 0 {
			t.Errorf("the new LUN was written to (first non-zero byte at %d) while the old volume's filesystem was mounted over it", off)
		}
	})

	t.Run("staging mount lost", func(t *testing.T) {
		defer lost.cleanup(t, ctx)
		unmount(t, lost.target, lost.staging)
		lt.ReplaceLUN(1, 64<<20)
		newLUN := lt.BackingFile(1)
		wantRefused(t, "NodeStageVolume after the staging mount was lost", lost.stage(ctx))
		if isMounted(t, lost.staging) {
			t.Errorf("staging path mounted after the refused stage")
		}
		wantRefused(t, "NodePublishVolume after the refused stage", lost.publishAt(ctx, lost.target))
		resp, err := lost.stats(ctx, lost.staging)
		wantAbnormal(t, "NodeGetVolumeStats after the refused stage", resp, err)
		if off := firstNonZero(t, newLUN); off >= 0 {
			t.Errorf("the new LUN was written to (first non-zero byte at %d): it was used as the old volume", off)
		}
	})
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Errorf("%d sessions left after unstaging both volumes", n)
	}
	fault.Leaked(iscsiSessions(t, lt.IQN))
}

// TestVMISCSIFaultsMultipath runs the multipath fault tests
// (TestFaultMultipathISCSI*) with multipathd. Each reports a row of make
// reliability's fault table.
func TestVMISCSIFaultsMultipath(t *testing.T) {
	m := vm.RunGuestTests(t,
		vm.WithTestRun(iscsi.GuestRun("^TestFaultMultipathISCSI")),
		vm.WithModules("iscsi_tcp", "target_core_mod", "target_core_iblock", "iscsi_target_mod", "loop", "dm_delay"),
		vm.WithIscsid(),
		vm.WithMultipathd(),
		vm.WithTimeout(12*time.Minute))
	reliability.ReportFaults(t, m.Output())
}

// restartIscsid kills iscsid (SIGKILL, as a crash) and starts it again.
func restartIscsid() error {
	procs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == "iscsid" {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			unix.Kill(pid, unix.SIGKILL)
		}
	}
	// The new iscsid binds the socket the old one held: wait until the
	// old one is gone (a killed iscsid in the middle of logins can take
	// seconds on a loaded host), then start it, again while the socket
	// is still held.
	for range 500 {
		gone := true
		for _, p := range procs {
			if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == "iscsid" {
				gone = false
			}
		}
		if gone {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	var err error
	var out []byte
	for range 25 {
		if out, err = exec.Command("iscsid").CombinedOutput(); err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("start iscsid again: %v: %s", err, out)
}

// TestFaultMultipathISCSISilentPortal: a multipath volume lists two
// portals and the first drops every packet. At berth serve's default login
// settings the stage succeeds over the other one within 30 s (the logins
// run at once), the volume's condition names the dead portal, and unstage
// leaves nothing behind.
func TestFaultMultipathISCSISilentPortal(t *testing.T) {
	vm.RequireGuest(t)
	t.Run("NoAnswer", func(t *testing.T) {
		testSilentFirstPortal(t, "iSCSI silent first portal (no answer), multipath", "127.0.0.2:3260", map[string]string{})
	})
	// No SYN-ACK and no RST either.
	t.Run("BlackHole", func(t *testing.T) {
		testSilentFirstPortal(t, "iSCSI silent first portal (black hole), multipath", target.BlackHole(t)+":3260", map[string]string{})
	})
}

// TestFaultMultipathISCSISilentPortalManyLUNs: three volumes, LUNs of one
// target behind two portals of which the first is silent, are staged at
// once. Each login through a portal holds that portal's lock, so without
// more each stage would wait for the silent portal in turn; each succeeds
// within 30 s instead, the bound one volume has.
func TestFaultMultipathISCSISilentPortalManyLUNs(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "iSCSI silent first portal (no answer), 3 multipath LUNs staged at once")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	const dead = "127.0.0.4:3260"
	target.SilentListener(t, dead)
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const bound = 30 * time.Second
	var vols []*faultVolume
	for lun := range 3 {
		wwid := lt.AddLUN(lun, 64<<20)
		vols = append(vols, newFaultVolume(t, node, fmt.Sprintf("vol-silent-lun%d", lun), map[string]string{"iqn": lt.IQN, "lun": strconv.Itoa(lun), "wwid": wwid,
			"portals": `["` + dead + `","127.0.0.1:3260"]`}))
	}
	var wg sync.WaitGroup
	for _, v := range vols {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, bound)
			defer cancel()
			start := time.Now()
			if err := v.stage(ctx); err != nil {
				t.Errorf("NodeStageVolume %s with a silent portal: %v after %v", v.id, err, time.Since(start))
				return
			}
			took := time.Since(start)
			t.Logf("%s staged over the live portal in %v", v.id, took.Round(time.Millisecond))
			if took > bound {
				t.Errorf("stage of %s took %v, more than %v", v.id, took, bound)
			}
		})
	}
	wg.Wait()
	settle(t)
	for _, v := range vols {
		if _, err := v.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
			t.Errorf("NodeUnstageVolume %s: %v", v.id, err)
		}
	}
	fault.Leaked(assertNoSessionsOrRecords(t, lt.IQN))
}

// TestFaultISCSISilentPortalSinglePath: the same for a single-path volume
// (multipath "false"), which tries its portals in order: the second one
// answers within 30 s of the stage. The portals of a single-path volume
// are alternatives, not paths: once it runs over one, its condition is
// normal, and the stage's log names the portal that did not answer.
func TestFaultISCSISilentPortalSinglePath(t *testing.T) {
	vm.RequireGuest(t)
	t.Run("NoAnswer", func(t *testing.T) {
		testSilentFirstPortal(t, "iSCSI silent first portal (no answer), single path", "127.0.0.3:3260", map[string]string{iscsi.KeyMultipath: "false"})
	})
	t.Run("BlackHole", func(t *testing.T) {
		testSilentFirstPortal(t, "iSCSI silent first portal (black hole), single path", target.BlackHole(t)+":3260", map[string]string{iscsi.KeyMultipath: "false"})
	})
}

func testSilentFirstPortal(t *testing.T, name, dead string, vctx map[string]string) {
	fault := reliability.StartFault(t, name)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	if strings.HasPrefix(dead, "127.") {
		target.SilentListener(t, dead)
	}
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The silent portal costs (1 + retries) * the login timeout; the live
	// portal, the disk and the map a few seconds more. The kubelet's
	// budget for one stage call is 2 minutes.
	const bound = 30 * time.Second
	maps.Copy(vctx, map[string]string{"iqn": lt.IQN, "lun": "0", "wwid": wwid, "portals": `["` + dead + `","127.0.0.1:3260"]`})
	v := newFaultVolume(t, node, "vol-silent", vctx)
	sctx, scancel := context.WithTimeout(ctx, bound)
	defer scancel()
	start := time.Now()
	if err := v.stage(sctx); err != nil {
		t.Fatalf("NodeStageVolume with a silent portal %s: %v after %v", dead, err, time.Since(start))
	}
	took := time.Since(start)
	t.Logf("staged over the live portal in %v (bound %v)", took.Round(time.Millisecond), bound)
	if took > bound {
		t.Errorf("stage took %v, more than %v", took, bound)
	}
	if err := v.publishAt(ctx, v.target); err != nil {
		t.Fatal(err)
	}
	v.writeData(t)
	if vctx[iscsi.KeyMultipath] != "false" {
		resp, err := v.stats(ctx, v.target)
		switch {
		case err != nil:
			t.Errorf("NodeGetVolumeStats: %v", err)
		case !resp.GetVolumeCondition().GetAbnormal() || !strings.Contains(resp.GetVolumeCondition().GetMessage(), strings.Split(dead, ":")[0]):
			t.Errorf("condition %v: want abnormal, naming the dead portal %s", resp.GetVolumeCondition(), dead)
		default:
			t.Logf("condition: abnormal: %s", resp.GetVolumeCondition().GetMessage())
		}
	}
	settle(t)
	v.cleanup(t, ctx)
	fault.Leaked(assertNoSessionsOrRecords(t, lt.IQN))
}

// settle waits for udev to finish with new devices (its probes hold a
// new multipath map open for a moment, long before a real unstage).
func settle(t *testing.T) {
	t.Helper()
	if out, err := exec.Command("udevadm", "settle", "--timeout=30").CombinedOutput(); err != nil {
		t.Logf("udevadm settle: %v: %s", err, out)
	}
}

// assertNoSessionsOrRecords fails t for each session and node record of
// the target left on the node, and returns how many are.
func assertNoSessionsOrRecords(t *testing.T, iqn string) int {
	t.Helper()
	left := iscsiSessions(t, iqn)
	if left != 0 {
		t.Errorf("%d sessions left after unstage", left)
	}
	for _, d := range []string{"/etc/iscsi/nodes", "/var/lib/iscsi/nodes"} {
		if ents, _ := os.ReadDir(filepath.Join(d, iqn)); len(ents) > 0 {
			t.Errorf("node records left in %s/%s", d, iqn)
			left += len(ents)
		}
	}
	return left
}

// TestFaultMultipathISCSIIscsidRestart: iscsid is killed (SIGKILL) and
// started again in the middle of the stage of a two-portal volume, right
// after the first session appears. The stage succeeds, or fails with
// Unavailable and the CO's retry succeeds; the volume carries data and
// unstages leaving no session and no record.
func TestFaultMultipathISCSIIscsidRestart(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "iscsid killed and restarted in the middle of a multipath stage")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260", "127.0.0.6:3260")
	wwid := lt.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-iscsid", map[string]string{"iqn": lt.IQN, "lun": "0", "wwid": wwid,
		"portals": `["127.0.0.1:3260","127.0.0.6:3260"]`, iscsi.ParamLoginTimeout: "3", iscsi.ParamLoginRetryMax: "1"})
	restarted := make(chan error, 1)
	start := time.Now()
	go func() {
		for iscsiSessions(t, lt.IQN) == 0 && time.Since(start) < 30*time.Second {
			time.Sleep(5 * time.Millisecond)
		}
		err := restartIscsid()
		t.Logf("iscsid killed and started again %v into the stage", time.Since(start).Round(time.Millisecond))
		restarted <- err
	}()
	err := v.stage(ctx)
	took := time.Since(start)
	if rerr := <-restarted; rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil {
		t.Logf("stage with iscsid killed in its middle: %v after %v", err, took.Round(time.Millisecond))
		if c := status.Code(err); c != codes.Unavailable && c != codes.Aborted {
			t.Errorf("stage failed with %v, want Unavailable or Aborted (the CO retries)", c)
		}
		start = time.Now()
		err = v.stage(ctx)
		took = time.Since(start)
	}
	if err != nil {
		t.Fatalf("NodeStageVolume after iscsid came back: %v", err)
	}
	t.Logf("staged in %v", took.Round(time.Millisecond))
	if err := v.publishAt(ctx, v.target); err != nil {
		t.Fatal(err)
	}
	v.writeData(t)
	if resp, err := v.stats(ctx, v.target); err != nil {
		t.Errorf("NodeGetVolumeStats: %v", err)
	} else {
		t.Logf("condition after the stage: abnormal=%v %s", resp.GetVolumeCondition().GetAbnormal(), resp.GetVolumeCondition().GetMessage())
	}
	settle(t)
	v.cleanup(t, ctx)
	fault.Leaked(assertNoSessionsOrRecords(t, lt.IQN))
}

// TestFaultISCSITargetOutage: the portal of a published volume stops
// answering for 20 s (its listener goes, its sessions drop; the
// initiator's reconnects are refused) while a writer fsyncs chunk after
// chunk, well within the replacement timeout. The writer sees no error,
// every fsync'd chunk is on the LUN afterwards (read back after a fresh
// stage), the condition is abnormal during the outage, naming the
// session's state, and normal after it; RPCs of a volume of another
// target answer meanwhile as fast as before.
func TestFaultISCSITargetOutage(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "iSCSI portal outage of 20 s under fsync'd writes, beside a healthy volume")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	down := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	down.AddLUN(0, 64<<20)
	other := iscsi.NewLIOTarget(t, "127.0.0.3:3260")
	other.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	v := newFaultVolume(t, node, "vol-outage", map[string]string{"targetPortal": down.Portal(1), "iqn": down.IQN, "lun": "0",
		iscsi.ParamReplacementTimeout: "120"})
	b := newFaultVolume(t, node, "vol-bystander", map[string]string{"targetPortal": other.Portal(1), "iqn": other.IQN, "lun": "0"})
	for _, x := range []*faultVolume{v, b} {
		if err := x.stage(ctx); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", x.id, err)
		}
		if err := x.publishAt(ctx, x.target); err != nil {
			t.Fatalf("NodePublishVolume %s: %v", x.id, err)
		}
	}
	// cycle runs b's RPCs as a CO moving it between pods, each within
	// deadline.
	cycle := func(times map[string][]time.Duration, deadline time.Duration) {
		t.Helper()
		for _, step := range []struct {
			name string
			fn   func(ctx context.Context) error
		}{
			{"NodeUnpublishVolume", func(ctx context.Context) error {
				_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: b.id, TargetPath: b.target})
				return err
			}},
			{"NodeUnstageVolume", func(ctx context.Context) error {
				_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: b.id, StagingTargetPath: b.staging})
				return err
			}},
			{"NodeStageVolume", b.stage},
			{"NodePublishVolume", func(ctx context.Context) error { return b.publishAt(ctx, b.target) }},
			{"NodeGetVolumeStats", func(ctx context.Context) error {
				resp, err := b.stats(ctx, b.target)
				if err == nil && resp.GetVolumeCondition().GetAbnormal() {
					err = fmt.Errorf("abnormal: %s", resp.GetVolumeCondition().GetMessage())
				}
				return err
			}},
		} {
			start := time.Now()
			sctx, cancel := context.WithTimeout(ctx, deadline)
			err := step.fn(sctx)
			cancel()
			if err != nil {
				t.Fatalf("%s %s (deadline %v): %v", step.name, b.id, deadline, err)
			}
			times[step.name] = append(times[step.name], time.Since(start))
		}
	}
	summary := func(times map[string][]time.Duration) (string, time.Duration) {
		var all []time.Duration
		var parts []string
		for _, name := range slices.Sorted(maps.Keys(times)) {
			d := slices.Sorted(slices.Values(times[name]))
			all = append(all, d...)
			parts = append(parts, fmt.Sprintf("%s p50 %v max %v", name, d[len(d)/2].Round(time.Millisecond), d[len(d)-1].Round(time.Millisecond)))
		}
		slices.Sort(all)
		return fmt.Sprintf("all %d: p50 %v max %v; %s", len(all), all[len(all)/2].Round(time.Millisecond), all[len(all)-1].Round(time.Millisecond), strings.Join(parts, ", ")), all[len(all)-1]
	}
	before := map[string][]time.Duration{}
	for range 3 {
		cycle(before, 2*time.Minute)
	}
	sb, baseMax := summary(before)
	t.Logf("RPCs of %s with every target up: %s", b.id, sb)
	// Each of b's RPCs during the outage has 3 s, or three times its
	// slowest with every target up on a slower host.
	limit := max(3*time.Second, 3*baseMax)

	// The writer: 16 KiB chunks in 1024 slots, each fsync'd.
	const chunk, slots = 16 << 10, 1024
	f, err := os.OpenFile(filepath.Join(v.target, "data"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	acked := make([][32]byte, slots)
	written := make([]bool, slots)
	var n atomic.Int64
	var werr error
	var maxSync time.Duration
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, chunk)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			seed := sha256.Sum256([]byte(fmt.Sprintf("write %d", i)))
			for j := 0; j < len(buf); j += len(seed) {
				copy(buf[j:], seed[:])
			}
			if _, err := f.WriteAt(buf, int64(i%slots*chunk)); err != nil {
				werr = fmt.Errorf("write %d: %w", i, err)
				return
			}
			s := time.Now()
			if err := f.Sync(); err != nil {
				werr = fmt.Errorf("fsync after write %d: %w", i, err)
				return
			}
			maxSync = max(maxSync, time.Since(s))
			acked[i%slots], written[i%slots] = sha256.Sum256(buf), true
			n.Add(1)
		}
	}()
	waitUntil := func(d time.Duration, what string, cond func() bool) {
		t.Helper()
		end := time.Now().Add(d)
		for !cond() {
			if time.Now().After(end) {
				t.Fatalf("%s: not within %v", what, d)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitUntil(10*time.Second, "the first fsync'd writes", func() bool { return n.Load() > 20 })

	const outage = 20 * time.Second
	start := time.Now()
	down.Vanish(1)
	var msg string
	waitUntil(15*time.Second, "the condition showing the outage", func() bool {
		resp, err := v.stats(ctx, v.target)
		if err != nil {
			t.Fatalf("NodeGetVolumeStats during the outage: %v", err)
		}
		msg = resp.GetVolumeCondition().GetMessage()
		return resp.GetVolumeCondition().GetAbnormal()
	})
	t.Logf("condition %v into the outage: abnormal: %s", time.Since(start).Round(time.Millisecond), msg)
	// The first report may come while the kernel has blocked the disk
	// but not yet failed the session: either state names the path.
	if !strings.Contains(msg, "portal "+down.Portal(1)+": ") ||
		!strings.Contains(msg, "session") && !strings.Contains(msg, "blocked") {
		t.Errorf("condition message %q does not name the portal and its state", msg)
	}
	during := map[string][]time.Duration{}
	for time.Since(start) < outage-5*time.Second {
		cycle(during, limit)
	}
	sd, _ := summary(during)
	t.Logf("RPCs of %s while %s is down, each within %v: %s", b.id, down.IQN, limit, sd)
	time.Sleep(time.Until(start.Add(outage)))
	progress := n.Load()
	down.Restore(1)
	back := time.Now()
	waitUntil(60*time.Second, "the condition showing recovery", func() bool {
		resp, err := v.stats(ctx, v.target)
		if err != nil {
			t.Fatalf("NodeGetVolumeStats after the outage: %v", err)
		}
		msg = resp.GetVolumeCondition().GetMessage()
		return !resp.GetVolumeCondition().GetAbnormal()
	})
	t.Logf("portal down for %v; condition normal %v after it came back: %s", back.Sub(start).Round(time.Millisecond), time.Since(back).Round(time.Millisecond), msg)
	waitUntil(30*time.Second, "writes after the outage", func() bool { return n.Load() > progress+20 })
	close(stop)
	<-done
	f.Close()
	if werr != nil {
		t.Fatalf("writer: %v", werr)
	}
	t.Logf("%d fsync'd writes of 16 KiB without error; longest fsync %v", n.Load(), maxSync.Round(time.Millisecond))

	// Read back through a fresh stage: a new session, nothing cached.
	v.cleanup(t, ctx)
	if err := v.stage(ctx); err != nil {
		t.Fatal(err)
	}
	if err := v.publishAt(ctx, v.target); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(v.target, "data"))
	if err != nil {
		t.Fatal(err)
	}
	bad := 0
	for s := range slots {
		if written[s] && ((s+1)*chunk > len(data) || sha256.Sum256(data[s*chunk:(s+1)*chunk]) != acked[s]) {
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d fsync'd chunks differ from what was written", bad)
	}
	fault.Lost(int64(bad * chunk))
	v.cleanup(t, ctx)
	b.cleanup(t, ctx)
	fault.Leaked(iscsiSessions(t, down.IQN) + iscsiSessions(t, other.IQN))
}

// killDaemon kills every process named comm with SIGKILL, as a crash, and
// waits until none is left.
func killDaemon(t *testing.T, comm string) {
	t.Helper()
	for range 100 {
		found := false
		procs, _ := filepath.Glob("/proc/[0-9]*/comm")
		for _, p := range procs {
			if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == comm {
				found = true
				pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
				unix.Kill(pid, unix.SIGKILL)
			}
		}
		if !found {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s does not die", comm)
}

// TestFaultMultipathISCSIMultipathdKilled: multipathd dies (SIGKILL) under
// a staged multipath volume. The map goes on carrying fsync'd writes, the
// volume's stats answer at once, a stage of another multipath volume
// fails at once with an error that names multipathd, and the volume
// unpublishes and unstages cleanly; with multipathd back, the other
// volume stages.
func TestFaultMultipathISCSIMultipathdKilled(t *testing.T) {
	vm.RequireGuest(t)
	fault := reliability.StartFault(t, "multipathd killed under a staged multipath volume")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := fault.Node(startAgent(t, logger))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260", "127.0.0.5:3260")
	w0 := lt.AddLUN(0, 64<<20)
	w1 := lt.AddLUN(1, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	vc := func(lun, wwid string) map[string]string {
		return map[string]string{"iqn": lt.IQN, "lun": lun, "wwid": wwid, "portals": `["127.0.0.1:3260","127.0.0.5:3260"]`}
	}
	v := newFaultVolume(t, node, "vol-mp", vc("0", w0))
	if err := v.stage(ctx); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if err := v.publishAt(ctx, v.target); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	killDaemon(t, "multipathd")
	v.writeData(t)
	start := time.Now()
	resp, err := v.stats(ctx, v.target)
	t.Logf("NodeGetVolumeStats without multipathd in %v: %v, %v", time.Since(start).Round(time.Millisecond), resp.GetVolumeCondition(), err)
	if err != nil || resp.GetVolumeCondition().GetAbnormal() {
		t.Errorf("stats of a healthy map without multipathd: %v, %v", resp.GetVolumeCondition(), err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("NodeGetVolumeStats took %v", d)
	}
	other := newFaultVolume(t, node, "vol-mp-other", vc("1", w1))
	start = time.Now()
	err = other.stage(ctx)
	took := time.Since(start)
	t.Logf("NodeStageVolume without multipathd: %v in %v", err, took.Round(time.Millisecond))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "multipathd") {
		t.Errorf("stage of a multipath volume without multipathd: %v, want Unavailable naming multipathd", err)
	}
	if took > 10*time.Second {
		t.Errorf("the refusal took %v", took)
	}
	v.cleanup(t, ctx)
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Errorf("%d sessions left after unstage", n)
	}
	if out, err := exec.Command("multipathd").CombinedOutput(); err != nil {
		t.Fatalf("start multipathd again: %v: %s", err, out)
	}
	eventually := time.Now().Add(20 * time.Second)
	for exec.Command("multipathd", "show", "daemon").Run() != nil {
		if time.Now().After(eventually) {
			t.Fatal("multipathd does not answer after its restart")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := other.stage(ctx); err != nil {
		t.Fatalf("NodeStageVolume with multipathd back: %v", err)
	}
	if err := other.publishAt(ctx, other.target); err != nil {
		t.Fatal(err)
	}
	settle(t)
	other.cleanup(t, ctx)
	fault.Leaked(iscsiSessions(t, lt.IQN))
}
