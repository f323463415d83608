package iscsi_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
)

// startAgent serves berth's CSI node service with the iscsi transport on a
// unix socket, as `berth serve` wires it, and returns a client of it.
func startAgent(t testing.TB, logger *slog.Logger) csi.NodeClient {
	l := csitest.Listener(t)
	return csitest.StartAgent(t, logger, l, iscsiTransport(t, l, logger))
}

// iscsiTransport is the iscsi transport on l as `berth serve` builds it.
func iscsiTransport(t testing.TB, l *devices.Listener, logger *slog.Logger) agent.Transport {
	t.Helper()
	// The login settings berth serve gives every session by default.
	tr, err := iscsi.New(iscsi.Options{Listener: l, Logger: logger, Params: map[string]int{
		iscsi.ParamLoginTimeout: iscsi.DefaultLoginTimeout, iscsi.ParamLoginRetryMax: iscsi.DefaultLoginRetryMax}})
	if err != nil {
		t.Fatal(err)
	}
	return agent.TransportFunc(agent.TransportKind{Name: iscsi.Name, Keys: iscsi.TransportKeys()}, tr.Parse)
}

// lockedBuffer is a bytes.Buffer for concurrent writers.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func iscsiSessions(t testing.TB, iqn string) int {
	t.Helper()
	ents, _ := os.ReadDir("/sys/class/iscsi_session")
	n := 0
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join("/sys/class/iscsi_session", e.Name(), "targetname"))
		if strings.TrimSpace(string(b)) == iqn {
			n++
		}
	}
	return n
}

// TestGuestISCSIAgentLifecycle drives a CHAP-protected iSCSI volume through
// the agent's gRPC API: stage, publish, write, unpublish, unstage (logout),
// stage again and read the data back, online expand, and the errors the CO
// sees for wrong credentials and a bad volume_context.
func TestGuestISCSIAgentLifecycle(t *testing.T) {
	vm.RequireGuest(t)
	var logs lockedBuffer
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(csitest.LogWriter(t), &logs), &slog.HandlerOptions{Level: slog.LevelDebug}))
	node := startAgent(t, logger)
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddLUN(0, 64<<20)
	secrets := map[string]string{iscsi.SecretSessionUsername: "csiuser", iscsi.SecretSessionPassword: "Csi-Secr3t-Pass"}
	lt.SetCHAP("csiuser", secrets[iscsi.SecretSessionPassword], "", "")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	dir := t.TempDir()
	staging := filepath.Join(dir, "staging")
	targetPath := filepath.Join(dir, "pod", "vol")
	os.MkdirAll(staging, 0o750)
	os.MkdirAll(filepath.Dir(targetPath), 0o750)
	id := "vol-iscsi"
	vctx := map[string]string{"targetPortal": lt.Portal(1), "iqn": lt.IQN, "lun": "0", "wwid": wwid, "sessionCHAPAuth": "true"}
	capability := csitest.MountCap("ext4")

	stage := func() {
		t.Helper()
		start := time.Now()
		if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			VolumeCapability: capability, VolumeContext: vctx, Secrets: secrets}); err != nil {
			t.Fatalf("NodeStageVolume: %v", err)
		}
		t.Logf("NodeStageVolume in %v", time.Since(start).Round(time.Millisecond))
		if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			VolumeCapability: capability, VolumeContext: vctx, Secrets: secrets}); err != nil {
			t.Fatalf("repeated NodeStageVolume: %v", err)
		}
	}
	publish := func() {
		t.Helper()
		if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			TargetPath: targetPath, VolumeCapability: capability, VolumeContext: vctx}); err != nil {
			t.Fatalf("NodePublishVolume: %v", err)
		}
	}
	unpublishUnstage := func() {
		t.Helper()
		for range 2 {
			if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetPath}); err != nil {
				t.Fatalf("NodeUnpublishVolume: %v", err)
			}
		}
		for range 2 {
			if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
				t.Fatalf("NodeUnstageVolume: %v", err)
			}
		}
		if n := iscsiSessions(t, lt.IQN); n != 0 {
			t.Fatalf("%d sessions left after unstage", n)
		}
	}

	stage()
	if n := iscsiSessions(t, lt.IQN); n != 1 {
		t.Fatalf("%d sessions after stage", n)
	}
	// The transport logs through the request's logger: its lines carry
	// the volume ID, so one filter shows the volume's whole life.
	transportLines := 0
	for _, line := range strings.Split(logs.String(), "\n") {
		if !strings.Contains(line, `msg="iSCSI login"`) && !strings.Contains(line, `msg="iSCSI path attached"`) {
			continue
		}
		transportLines++
		if !strings.Contains(line, "volume_id="+id) {
			t.Errorf("transport line without volume_id=%s: %s", id, line)
		}
	}
	if transportLines == 0 {
		t.Errorf("no iSCSI login or path line logged during stage:\n%s", logs.String())
	}
	publish()
	payload := make([]byte, 1<<20)
	rand.Read(payload)
	if err := os.WriteFile(filepath.Join(targetPath, "data"), payload, 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	unpublishUnstage()

	stage()
	publish()
	got, err := os.ReadFile(filepath.Join(targetPath, "data"))
	if err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("data after re-stage: %v (equal %v)", err, bytes.Equal(got, payload))
	}

	// Online expand: the LUN grows on the target, the CO asks the node.
	lt.Grow(0, 128<<20)
	resp, err := node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: targetPath,
		StagingTargetPath: staging, VolumeCapability: capability, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}})
	if err != nil {
		t.Fatalf("NodeExpandVolume: %v", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(targetPath, &st); err != nil {
		t.Fatal(err)
	}
	if total := int64(st.Blocks) * st.Bsize; total < 100<<20 {
		t.Fatalf("filesystem is %d bytes after expand (reported %d)", total, resp.CapacityBytes)
	}
	t.Logf("expanded to %d bytes", resp.CapacityBytes)
	unpublishUnstage()

	// Wrong credentials: PermissionDenied, and the message names the
	// cause but not the secret.
	bad := map[string]string{iscsi.SecretSessionUsername: "csiuser", iscsi.SecretSessionPassword: "Not-The-Password"}
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id + "-bad", StagingTargetPath: staging,
		VolumeCapability: capability, VolumeContext: vctx, Secrets: bad})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "authentication") || strings.Contains(err.Error(), "Not-The-Password") {
		t.Fatalf("wrong CHAP secret: %v", err)
	}
	// A bad volume_context: InvalidArgument naming the field, nothing done.
	badCtx := map[string]string{"targetPortal": lt.Portal(1), "iqn": lt.IQN, "lun": "70000"}
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id + "-badctx", StagingTargetPath: staging,
		VolumeCapability: capability, VolumeContext: badCtx})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "lun") {
		t.Fatalf("bad lun: %v", err)
	}
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Fatalf("%d sessions left after failed stages", n)
	}
}

// TestBenchGuestISCSI compares NodeStageVolume through the agent's gRPC
// API with the same work done by hand (iscsiadm login with the default
// automatic scan, mkfs.ext4, mount) on identical fresh LUNs in the same
// guest. It prints one "BENCH" line per method with every sample and the
// median. Run by TestVMBenchISCSI (BERTH_BENCH=1).
func TestBenchGuestISCSI(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("set BERTH_BENCH=1 to run the iSCSI stage benchmark")
	}
	const rounds = 15
	var steps csitest.StepTimes
	logger := slog.New(steps.Handler(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelWarn})))
	node := startAgent(t, logger)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	l := csitest.Listener(t)
	// The login settings berth serve gives every session by default.
	tr, err := iscsi.New(iscsi.Options{Listener: l, Logger: logger, Params: map[string]int{
		iscsi.ParamLoginTimeout: iscsi.DefaultLoginTimeout, iscsi.ParamLoginRetryMax: iscsi.DefaultLoginRetryMax}})
	if err != nil {
		t.Fatal(err)
	}
	var berth, unfenced, raw, attach, login, berthXFS, rawXFS []time.Duration
	// stage stages a fresh LUN through the agent (login, targeted scan,
	// WWID check, probe, mkfs, mount) and unstages it outside the
	// measurement; rawStage does the same by hand on an identical LUN of
	// another target, with berth's own mkfs options. mkfs.xfs makes
	// nothing under 300 MB: xfs LUNs are 320 MiB, ext4 ones 64 MiB.
	lunSize := map[string]int64{"ext4": 64 << 20, "xfs": 320 << 20}
	// stage fences the volume (the default for a single writer: register
	// the node's key, reserve) unless fencing is "none".
	stage := func(i int, fsType, fencing string) time.Duration {
		lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
		wwid := lt.AddLUN(0, lunSize[fsType])
		staging := filepath.Join(t.TempDir(), "staging")
		os.MkdirAll(staging, 0o750)
		id := fmt.Sprintf("bench-%s-%s-%d", fsType, fencing, i)
		vctx := map[string]string{"targetPortal": lt.Portal(1), "iqn": lt.IQN, "lun": "0", "wwid": wwid}
		if fencing != "" {
			vctx["fencing"] = fencing
		}
		start := time.Now()
		if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			VolumeCapability: csitest.MountCap(fsType), VolumeContext: vctx}); err != nil {
			t.Fatal(err)
		}
		d := time.Since(start)
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
		lt.Destroy()
		return d
	}
	mkfs := map[string][]string{
		"ext4": {"/usr/sbin/mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"},
		"xfs":  {"/usr/sbin/mkfs.xfs", "-q", "-f", "-K"},
	}
	rawStage := func(fsType string) time.Duration {
		lr := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
		lr.AddLUN(0, lunSize[fsType])
		mnt := filepath.Join(t.TempDir(), "mnt")
		os.MkdirAll(mnt, 0o750)
		start := time.Now()
		run(t, "iscsiadm", "-m", "node", "-o", "new", "-T", lr.IQN, "-p", lr.Portal(1))
		run(t, "iscsiadm", "-m", "node", "-T", lr.IQN, "-p", lr.Portal(1), "--login")
		dev := waitSessionDisk(t, lr.IQN)
		run(t, mkfs[fsType][0], append(mkfs[fsType][1:], dev)...)
		if err := unix.Mount(dev, mnt, fsType, 0, ""); err != nil {
			t.Fatal(err)
		}
		d := time.Since(start)
		unix.Unmount(mnt, 0)
		run(t, "iscsiadm", "-m", "node", "-T", lr.IQN, "-p", lr.Portal(1), "--logout")
		run(t, "iscsiadm", "-m", "node", "-o", "delete", "-T", lr.IQN, "-p", lr.Portal(1))
		lr.Destroy()
		return d
	}
	// pair measures both sides; the one that goes first alternates, so
	// that the other's clean-up (logout, the target's removal) weighs on
	// both alike.
	pair := func(i int, fsType string) (b, r time.Duration) {
		if i%2 == 0 {
			b = stage(i, fsType, "")
			return b, rawStage(fsType)
		}
		r = rawStage(fsType)
		return stage(i, fsType, ""), r
	}
	// trio adds an unfenced stage to the ext4 pair, in an order that
	// turns with the round, to measure what fencing costs a stage.
	// Each ext4 stage's steps go to the list of its way; the xfs
	// stages' steps (the pairs between) to xfsSteps.
	var fencedSteps, unfencedSteps, xfsSteps csitest.StepTimes
	trio := func(i int) (b, n, r time.Duration) {
		legs := []func(){
			func() { steps.MoveTo(&xfsSteps); b = stage(i, "ext4", ""); steps.MoveTo(&fencedSteps) },
			func() { steps.MoveTo(&xfsSteps); n = stage(i, "ext4", "none"); steps.MoveTo(&unfencedSteps) },
			func() { r = rawStage("ext4") },
		}
		for k := range legs {
			legs[(i+k)%len(legs)]()
		}
		return b, n, r
	}
	// Round 0 is not counted: a guest's first stage pays for cold
	// caches (the programs, the agent's first RPC).
	for i := range rounds + 1 {
		// The transport alone (login, targeted scan, disk by uevent,
		// WWID check) against iscsiadm login with automatic scan and a
		// script's wait for the disk.
		la := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
		aw := la.AddLUN(0, 64<<20)
		tg, err := tr.Parse(map[string]string{"targetPortal": la.Portal(1), "iqn": la.IQN, "lun": "0", "wwid": aw}, nil)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if _, err := tg.Attach(ctx); err != nil {
			t.Fatal(err)
		}
		da := time.Since(start)
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		la.Destroy()
		ll := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
		ll.AddLUN(0, 64<<20)
		start = time.Now()
		run(t, "iscsiadm", "-m", "node", "-o", "new", "-T", ll.IQN, "-p", ll.Portal(1))
		run(t, "iscsiadm", "-m", "node", "-T", ll.IQN, "-p", ll.Portal(1), "--login")
		waitSessionDisk(t, ll.IQN)
		dl := time.Since(start)
		run(t, "iscsiadm", "-m", "node", "-T", ll.IQN, "-p", ll.Portal(1), "--logout")
		run(t, "iscsiadm", "-m", "node", "-o", "delete", "-T", ll.IQN, "-p", ll.Portal(1))
		ll.Destroy()

		b4, n4, r4 := trio(i)
		bx, rx := pair(i, "xfs")
		if i == 0 {
			continue
		}
		attach, login = append(attach, da), append(login, dl)
		berth, raw = append(berth, b4), append(raw, r4)
		unfenced = append(unfenced, n4)
		berthXFS, rawXFS = append(berthXFS, bx), append(rawXFS, rx)
	}
	report := func(name string, d []time.Duration) {
		s := slices.Clone(d)
		slices.Sort(s)
		ms := make([]string, len(d))
		for i, x := range d {
			ms[i] = fmt.Sprintf("%.0f", float64(x.Microseconds())/1000)
		}
		t.Logf("BENCH iscsi-stage %s median_ms=%.0f samples_ms=%s", name, float64(s[len(s)/2].Microseconds())/1000, strings.Join(ms, ","))
	}
	report("berth-NodeStageVolume", berth)
	report("berth-NodeStageVolume-fencing-none", unfenced)
	report("raw-iscsiadm-mkfs-mount", raw)
	report("berth-transport-Attach", attach)
	report("raw-iscsiadm-login-disk", login)
	report("berth-NodeStageVolume-xfs", berthXFS)
	report("raw-iscsiadm-mkfs.xfs-mount", rawXFS)
	median := func(d []time.Duration) time.Duration { s := slices.Clone(d); slices.Sort(s); return s[len(s)/2] }
	perRound := func(b, r []time.Duration) float64 {
		ratios := make([]float64, len(b))
		for i := range b {
			ratios[i] = float64(b[i]) / float64(r[i])
		}
		slices.Sort(ratios)
		return ratios[len(ratios)/2]
	}
	t.Logf("BENCH iscsi-stage berth/raw, ext4 64 MiB: ratio of the medians %.2f, median of the %d per-round ratios %.2f (goal <= 1.05)",
		float64(median(berth))/float64(median(raw)), rounds, perRound(berth, raw))
	t.Logf("BENCH iscsi-stage berth/raw, xfs 320 MiB: ratio of the medians %.2f, median of the %d per-round ratios %.2f (goal <= 1.05)",
		float64(median(berthXFS))/float64(median(rawXFS)), rounds, perRound(berthXFS, rawXFS))
	t.Logf("BENCH iscsi-stage fencing, ext4 64 MiB: fenced/unfenced stage, ratio of the medians %.2f, median of the %d per-round ratios %.2f (goal <= 1.05); unfenced berth/raw, ratio of the medians %.2f",
		float64(median(berth))/float64(median(unfenced)), rounds, perRound(berth, unfenced), float64(median(unfenced))/float64(median(raw)))
	steps.MoveTo(&xfsSteps)
	t.Logf("BENCH iscsi-stage berth steps, xfs, %s", xfsSteps.Summary())
	t.Logf("BENCH iscsi-stage berth steps, ext4 fenced, %s", fencedSteps.Summary())
	t.Logf("BENCH iscsi-stage berth steps, ext4 unfenced, %s", unfencedSteps.Summary())
}

// TestBenchGuestISCSIConcurrent stages 8 LUNs of one target at once
// through the agent and compares the wall time with the same work by
// hand at once: one iscsiadm login (its automatic scan finds every LUN),
// then for each LUN a wait for its disk, mkfs.ext4 and mount. Fresh
// targets each round; run by TestVMBenchISCSI (BERTH_BENCH=1). Round 0
// is not counted, as in TestBenchGuestISCSI: it pays for the agent's
// first RPC (the client's connection) and, on whichever side goes first,
// for the programs read from disk; its ratio is printed apart.
func TestBenchGuestISCSIConcurrent(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("set BERTH_BENCH=1 to run the iSCSI stage benchmark")
	}
	const rounds, luns = 9, 8
	var steps csitest.StepTimes
	node := startAgent(t, slog.New(steps.Handler(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelWarn}))))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var berth, raw []time.Duration
	var berthCPU, rawCPU []guestCPU
	for i := range rounds + 1 {
		lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
		wwids := make([]string, luns)
		for l := range luns {
			wwids[l] = lt.AddLUN(l, 64<<20)
		}
		dir := t.TempDir()
		var wg sync.WaitGroup
		errs := make([]error, luns)
		// The side that goes first alternates, so that the other's
		// clean-up weighs on both alike.
		berthSide := func() {
			c0 := readGuestCPU(t)
			start := time.Now()
			for l := range luns {
				wg.Go(func() {
					staging := filepath.Join(dir, strconv.Itoa(l))
					os.MkdirAll(staging, 0o750)
					_, errs[l] = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: fmt.Sprintf("c%d-%d", i, l),
						StagingTargetPath: staging, VolumeCapability: csitest.MountCap("ext4"),
						VolumeContext: map[string]string{"targetPortal": lt.Portal(1), "iqn": lt.IQN, "lun": strconv.Itoa(l), "wwid": wwids[l]}})
				})
			}
			wg.Wait()
			berth = append(berth, time.Since(start))
			berthCPU = append(berthCPU, readGuestCPU(t).sub(c0))
			for l := range luns {
				if errs[l] != nil {
					t.Fatalf("stage LUN %d: %v", l, errs[l])
				}
				if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: fmt.Sprintf("c%d-%d", i, l),
					StagingTargetPath: filepath.Join(dir, strconv.Itoa(l))}); err != nil {
					t.Fatal(err)
				}
			}
			lt.Destroy()
		}
		rawSide := func() {
			lr := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
			for l := range luns {
				lr.AddLUN(l, 64<<20)
			}
			mnt := t.TempDir()
			c0 := readGuestCPU(t)
			start := time.Now()
			run(t, "iscsiadm", "-m", "node", "-o", "new", "-T", lr.IQN, "-p", lr.Portal(1))
			run(t, "iscsiadm", "-m", "node", "-T", lr.IQN, "-p", lr.Portal(1), "--login")
			for l := range luns {
				wg.Go(func() {
					dev, err := waitLUNDisk(ctx, lr.IQN, l)
					if err == nil {
						err = exec.Command("/usr/sbin/mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", dev).Run()
					}
					if err == nil {
						p := filepath.Join(mnt, strconv.Itoa(l))
						os.MkdirAll(p, 0o750)
						err = unix.Mount(dev, p, "ext4", 0, "")
					}
					errs[l] = err
				})
			}
			wg.Wait()
			raw = append(raw, time.Since(start))
			rawCPU = append(rawCPU, readGuestCPU(t).sub(c0))
			for l := range luns {
				if errs[l] != nil {
					t.Fatalf("by hand, LUN %d: %v", l, errs[l])
				}
				unix.Unmount(filepath.Join(mnt, strconv.Itoa(l)), 0)
			}
			run(t, "iscsiadm", "-m", "node", "-T", lr.IQN, "-p", lr.Portal(1), "--logout")
			run(t, "iscsiadm", "-m", "node", "-o", "delete", "-T", lr.IQN, "-p", lr.Portal(1))
			lr.Destroy()
		}
		if i%2 == 0 {
			berthSide()
			rawSide()
		} else {
			rawSide()
			berthSide()
		}
	}
	// Round 0 warmed up.
	warm := float64(berth[0]) / float64(raw[0])
	berth, raw, berthCPU, rawCPU = berth[1:], raw[1:], berthCPU[1:], rawCPU[1:]
	ratios := make([]float64, rounds)
	for i := range ratios {
		ratios[i] = float64(berth[i]) / float64(raw[i])
	}
	slices.Sort(ratios)
	t.Logf("BENCH iscsi-stage %d LUNs at once: berth %v, raw %v; median of the %d per-round ratios %.2f (goal <= 1.15); uncounted round 0: %.2f",
		luns, berth, raw, rounds, ratios[len(ratios)/2], warm)
	t.Logf("BENCH iscsi-stage %d LUNs at once, berth steps, %s", luns, steps.Summary())
	t.Logf("BENCH iscsi-stage %d LUNs at once, guest CPU per round (median): berth %s; raw %s", luns, medianCPU(berthCPU), medianCPU(rawCPU))
}

// guestCPU is CPU time spent in the guest: by this process (the agent
// and the test), by the programs it ran and waited for, and by the rest
// (kernel threads: the iSCSI initiator and target, loop workers).
type guestCPU struct{ process, programs, rest time.Duration }

// readGuestCPU reads the guest's busy time (/proc/stat) and this
// process's and its waited-for children's CPU time (getrusage).
func readGuestCPU(t *testing.T) guestCPU {
	t.Helper()
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		t.Fatal(err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		t.Fatalf("/proc/stat: %q", line)
	}
	var busy time.Duration
	for i, s := range f[1:8] { // user nice system idle iowait irq softirq
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if i != 3 && i != 4 {
			busy += time.Duration(n) * 10 * time.Millisecond // USER_HZ is 100
		}
	}
	var self, children unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &self); err != nil {
		t.Fatal(err)
	}
	if err := unix.Getrusage(unix.RUSAGE_CHILDREN, &children); err != nil {
		t.Fatal(err)
	}
	cpu := func(r unix.Rusage) time.Duration { return time.Duration(r.Utime.Nano() + r.Stime.Nano()) }
	return guestCPU{process: cpu(self), programs: cpu(children), rest: busy - cpu(self) - cpu(children)}
}

func (c guestCPU) sub(o guestCPU) guestCPU {
	return guestCPU{process: c.process - o.process, programs: c.programs - o.programs, rest: c.rest - o.rest}
}

func medianCPU(cs []guestCPU) string {
	med := func(f func(guestCPU) time.Duration) time.Duration {
		var d []time.Duration
		for _, c := range cs {
			d = append(d, f(c))
		}
		slices.Sort(d)
		return d[len(d)/2].Round(10 * time.Millisecond)
	}
	return fmt.Sprintf("process %v, its programs %v, rest %v",
		med(func(c guestCPU) time.Duration { return c.process }),
		med(func(c guestCPU) time.Duration { return c.programs }),
		med(func(c guestCPU) time.Duration { return c.rest }))
}

// waitLUNDisk waits for the disk of LUN lun of the session to target iqn
// and returns its device path.
func waitLUNDisk(ctx context.Context, iqn string, lun int) (string, error) {
	for {
		ents, _ := os.ReadDir("/sys/class/iscsi_session")
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join("/sys/class/iscsi_session", e.Name(), "targetname"))
			if strings.TrimSpace(string(b)) != iqn {
				continue
			}
			disks, _ := filepath.Glob(filepath.Join("/sys/class/iscsi_session", e.Name(), "device", "target*", "*:"+strconv.Itoa(lun), "block", "*"))
			if len(disks) > 0 {
				dev := "/dev/" + filepath.Base(disks[0])
				if _, err := os.Stat(dev); err == nil {
					return dev, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("no disk for LUN %d of %s: %w", lun, iqn, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

// waitSessionDisk waits (polling, as a script would) for the first disk of
// the target's session.
func waitSessionDisk(t *testing.T, iqn string) string {
	t.Helper()
	end := time.Now().Add(60 * time.Second)
	for time.Now().Before(end) {
		ents, _ := os.ReadDir("/sys/class/iscsi_session")
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join("/sys/class/iscsi_session", e.Name(), "targetname"))
			if strings.TrimSpace(string(b)) != iqn {
				continue
			}
			disks, _ := filepath.Glob(filepath.Join("/sys/class/iscsi_session", e.Name(), "device", "target*", "*", "block", "*"))
			if len(disks) > 0 {
				dev := "/dev/" + filepath.Base(disks[0])
				if _, err := os.Stat(dev); err == nil {
					return dev
				}
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no disk for %s", iqn)
	return ""
}
