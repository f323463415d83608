package nvmeof_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMBenchNVMeoF measures NodeStageVolume of NVMe/TCP volumes (ext4)
// in a guest against the same kernel steps done by a shell script
// (testdata/raw-stage.sh) on identical namespaces: one volume, then 16
// at once. It runs only with BERTH_BENCH=1 (make bench); results are the
// lines marked "BENCH".
func TestVMBenchNVMeoF(t *testing.T) {
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1 (make bench)")
	}
	vm.RunGuestTests(t, vm.WithTestRun("^TestBenchNVMeoF"), vm.WithMemory(2048),
		vm.WithTimeout(15*time.Minute), vm.WithEnv(map[string]string{"BERTH_BENCH": "1"}))
}

// TestVMBenchNVMeoFFencing measures what fencing costs an NVMe/TCP stage:
// on a kernel whose nvmet has reservations, one ext4 volume staged with
// fencing (register, acquire), without it (fencing "none") and by hand,
// in an order that turns with the round.
func TestVMBenchNVMeoFFencing(t *testing.T) {
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1 (make bench)")
	}
	vm.RunGuestTests(t, vm.WithKernel("trixie-backports"), vm.WithTestRun("^TestBenchNVMeoFStage$"), vm.WithMemory(2048),
		vm.WithTimeout(15*time.Minute), vm.WithEnv(map[string]string{"BERTH_BENCH": "1", "BERTH_BENCH_FENCING": "1"}))
}

const benchVolumes = 16

func TestBenchNVMeoFStage(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1")
	}
	iterations := 9
	if s := os.Getenv("BERTH_BENCH_ITERATIONS"); s != "" {
		iterations, _ = strconv.Atoi(s)
	}
	var steps csitest.StepTimes
	logger := slog.New(steps.Handler(nil))
	node := startAgent(t, logger)
	nqn := "nqn.2026-01.io.berth:bench"
	var nss []target.NVMeNamespace
	fencing := os.Getenv("BERTH_BENCH_FENCING") == "1"
	for i := 0; i <= benchVolumes; i++ {
		nss = append(nss, target.NVMeNamespace{Size: 64 << 20, Reservations: fencing})
	}
	// The xfs namespace: mkfs.xfs makes nothing under 300 MB.
	xfsNSID := uint32(len(nss) + 1)
	nss = append(nss, target.NVMeNamespace{Size: 320 << 20})
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4450"}, Namespaces: nss})
	host, err := nvmeof.LoadHostIdentity(nvmeof.DefaultHostDir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	dir := t.TempDir()

	// wipe makes a namespace blank again, through the target's backing
	// device: all of it, since berth samples the whole device before it
	// formats (mkfs.ext4 leaves backup superblocks every 8 MiB). A
	// discard of the loop device punches the blocks out of its tmpfs
	// file, which then reads as zeros: writing zeros would fill tmpfs
	// (17 namespaces of 64 MiB are more than the guest's tmpfs holds).
	wipe := func(nsid uint32) {
		f, err := os.OpenFile(tgt.BackingDevice(nsid), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		size, err := unix.IoctlGetUint64(int(f.Fd()), unix.BLKGETSIZE64)
		if err != nil {
			t.Fatal(err)
		}
		if err := ioctlDiscard(f, 0, size); err != nil {
			t.Fatalf("discard %s: %v", tgt.BackingDevice(nsid), err)
		}
	}
	// unfenced makes berth's stages opt out of fencing. Each of berth's
	// rounds stages its wiped namespaces as new volumes, with IDs of
	// their own: berth never formats again a volume ID it formatted.
	unfenced := false
	round := 0
	req := func(nsid uint32) *csi.NodeStageVolumeRequest {
		staging := filepath.Join(dir, "staging", strconv.Itoa(int(nsid)))
		os.MkdirAll(staging, 0o750)
		fsType := "ext4"
		if nsid == xfsNSID {
			fsType = "xfs"
		}
		vctx := map[string]string{"nqn": nqn, "nsid": strconv.Itoa(int(nsid)), "traddr": "127.0.0.1", "trsvcid": "4450"}
		if unfenced {
			vctx["fencing"] = "none"
		}
		return &csi.NodeStageVolumeRequest{
			VolumeId: fmt.Sprintf("bench-%d-%d", nsid, round), StagingTargetPath: staging, VolumeCapability: csitest.MountCap(fsType),
			VolumeContext: vctx,
		}
	}
	// berth stages nsids at once and returns the wall time.
	berth := func(nsids []uint32) time.Duration {
		round++
		var wg sync.WaitGroup
		errs := make(chan error, len(nsids))
		start := time.Now()
		for _, n := range nsids {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := node.NodeStageVolume(ctx, req(n)); err != nil {
					errs <- fmt.Errorf("stage namespace %d: %w", n, err)
				}
			}()
		}
		wg.Wait()
		d := time.Since(start)
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		for _, n := range nsids {
			r := req(n)
			if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: r.VolumeId, StagingTargetPath: r.StagingTargetPath}); err != nil {
				t.Fatal(err)
			}
			wipe(n)
		}
		return d
	}
	// raw runs the shell script on nsids and returns its run time.
	raw := func(nsids []uint32, root string) time.Duration {
		args := []string{"testdata/raw-stage.sh", nqn, "127.0.0.1", "4450", host.NQN, host.ID, root}
		for _, n := range nsids {
			args = append(args, strconv.Itoa(int(n)))
		}
		cmd := exec.CommandContext(ctx, "/bin/sh", args...)
		if slices.Contains(nsids, xfsNSID) {
			cmd.Env = append(os.Environ(), "FSTYPE=xfs")
		}
		start := time.Now()
		out, err := cmd.CombinedOutput()
		d := time.Since(start)
		if err != nil {
			t.Fatalf("raw-stage.sh: %v: %s", err, out)
		}
		for _, n := range nsids {
			if root == "-" {
				break
			}
			if err := syscall.Unmount(filepath.Join(root, strconv.Itoa(int(n))), 0); err != nil {
				t.Fatal(err)
			}
		}
		ents, _ := os.ReadDir("/sys/class/nvme")
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
			if strings.TrimSpace(string(b)) == nqn {
				if err := os.WriteFile(filepath.Join("/sys/class/nvme", e.Name(), "delete_controller"), []byte("1"), 0); err != nil {
					t.Fatal(err)
				}
			}
		}
		for _, n := range nsids {
			wipe(n)
		}
		return d
	}
	median := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)/2]
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond)) }

	// pairs measures both sides on nsid, iterations times, after one
	// round of each that is not counted (a guest's first stage pays for
	// cold caches: the programs, the agent's first RPC); the side that
	// goes first alternates, so that the other's clean-up (the target
	// punching out the namespace, the controller's removal) weighs on
	// both alike.
	pairs := func(nsid uint32) (b, r []time.Duration) {
		berth([]uint32{nsid})
		raw([]uint32{nsid}, filepath.Join(dir, "raw"))
		for i := range iterations {
			if i%2 == 0 {
				b = append(b, berth([]uint32{nsid}))
				r = append(r, raw([]uint32{nsid}, filepath.Join(dir, "raw")))
			} else {
				r = append(r, raw([]uint32{nsid}, filepath.Join(dir, "raw")))
				b = append(b, berth([]uint32{nsid}))
			}
		}
		return b, r
	}
	if fencing {
		benchFencing(t, iterations, &steps, func(none bool) time.Duration {
			unfenced = none
			return berth([]uint32{1})
		}, func() time.Duration { return raw([]uint32{1}, filepath.Join(dir, "raw")) })
		return
	}
	b1, r1 := pairs(1)
	singleSteps := steps.Summary()
	bx, rx := pairs(xfsNSID)
	// The attach alone: Target.Attach (connect, uevent, verified device)
	// against the connect write and a device poll.
	l := csitest.Listener(t)
	tr, err := nvmeof.NewTransport(nvmeof.Options{Listener: l, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	tg, err := tr.Parse(req(1).VolumeContext, nil)
	if err != nil {
		t.Fatal(err)
	}
	var ba, ra []time.Duration
	for i := 0; i < iterations; i++ {
		start := time.Now()
		if _, err := tg.Attach(ctx); err != nil {
			t.Fatal(err)
		}
		ba = append(ba, time.Since(start))
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		ra = append(ra, raw([]uint32{1}, "-"))
	}
	var many []uint32
	for n := uint32(2); n <= benchVolumes+1; n++ {
		many = append(many, n)
	}
	b16 := berth(many)
	r16 := raw(many, filepath.Join(dir, "raw"))

	// Expand of namespace 1: berth's Target.Expand (no size given, as
	// NodeExpandVolume without a required size) once with no change and
	// once after the target grew, against a rescan written by hand and
	// a poll of the device's size after the same grow.
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	size := int64(64 << 20)
	var en, eg, rg []time.Duration
	for i := 0; i < iterations; i++ {
		start := time.Now()
		if got, err := tg.Expand(ctx); err != nil || got != size {
			t.Fatalf("Expand with no change: %d, %v; want %d", got, err, size)
		}
		en = append(en, time.Since(start))
		size += 8 << 20
		tgt.Grow(1, size)
		start = time.Now()
		if got, err := tg.Expand(ctx); err != nil || got != size {
			t.Fatalf("Expand after a grow: %d, %v; want %d", got, err, size)
		}
		eg = append(eg, time.Since(start))
		size += 8 << 20
		tgt.Grow(1, size)
		rg = append(rg, rawRescan(t, ctx, nqn, dev.Name, size))
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}

	t.Logf("BENCH nvmeof stage (NVMe/TCP loopback, ext4 64 MiB and xfs 320 MiB, TCG guest, median of %d):", iterations)
	// Each round stages with berth, then by hand: the ratio within a
	// round is free of the host's slow and fast phases.
	roundRatio := func(b, r []time.Duration) float64 {
		ratios := make([]float64, len(b))
		for i := range b {
			ratios[i] = float64(b[i]) / float64(r[i])
		}
		slices.Sort(ratios)
		return ratios[len(ratios)/2]
	}
	t.Logf("BENCH   1 volume, ext4: berth NodeStageVolume %s, raw kernel steps %s (berth/raw: ratio of the medians %.2f, median of the %d per-round ratios %.2f; goal <= 1.05)",
		ms(median(b1)), ms(median(r1)), float64(median(b1))/float64(median(r1)), len(b1), roundRatio(b1, r1))
	t.Logf("BENCH   1 volume, xfs : berth NodeStageVolume %s, raw kernel steps %s (berth/raw: ratio of the medians %.2f, median of the %d per-round ratios %.2f; goal <= 1.05)",
		ms(median(bx)), ms(median(rx)), float64(median(bx))/float64(median(rx)), len(bx), roundRatio(bx, rx))
	t.Logf("BENCH   berth steps, %s", singleSteps)
	t.Logf("BENCH   attach   : berth Target.Attach %s, raw connect + device %s", ms(median(ba)), ms(median(ra)))
	t.Logf("BENCH  %d volumes at once: berth %s (%s per volume), raw %s (%s per volume), berth/raw %.2f (goal <= 1.15)",
		benchVolumes, ms(b16), ms(b16/benchVolumes), ms(r16), ms(r16/benchVolumes), float64(b16)/float64(r16))
	t.Logf("BENCH   expand   : berth Target.Expand with no size, no change %s; after the target grew %s, raw rescan + size poll %s (berth/raw %.2f)",
		ms(median(en)), ms(median(eg)), ms(median(rg)), float64(median(eg))/float64(median(rg)))
	t.Logf("BENCH   single runs: berth stage %v; raw stage %v; berth attach %v; raw attach %v; berth expand %v; raw expand %v", b1, r1, ba, ra, eg, rg)
}

// rawRescan writes rescan_controller of the controllers of subsystem nqn
// and polls the size of block device name until it shows want bytes; it
// returns the time that took.
func rawRescan(t *testing.T, ctx context.Context, nqn, name string, want int64) time.Duration {
	t.Helper()
	start := time.Now()
	ents, _ := os.ReadDir("/sys/class/nvme")
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
		if strings.TrimSpace(string(b)) == nqn {
			if err := os.WriteFile(filepath.Join("/sys/class/nvme", e.Name(), "rescan_controller"), []byte("1"), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	for {
		b, err := os.ReadFile(filepath.Join("/sys/block", name, "size"))
		if err != nil {
			t.Fatal(err)
		}
		if n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); n*512 == want {
			return time.Since(start)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: size %s, want %d bytes", name, strings.TrimSpace(string(b)), want)
		case <-time.After(time.Millisecond):
		}
	}
}

// ioctlDiscard discards length bytes at offset of the block device f
// (BLKDISCARD).
func ioctlDiscard(f *os.File, offset, length uint64) error {
	r := [2]uint64{offset, length}
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), unix.BLKDISCARD, uintptr(unsafe.Pointer(&r[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// benchFencing stages one volume fenced, unfenced (stage(true)) and by
// hand (raw), iterations rounds after one that is not counted, in an
// order that turns with the round, and reports what fencing costs.
func benchFencing(t *testing.T, iterations int, steps *csitest.StepTimes, stage func(none bool) time.Duration, raw func() time.Duration) {
	var fenced, unfenced, byHand []time.Duration
	var fencedSteps, unfencedSteps csitest.StepTimes
	for i := range iterations + 1 {
		var f, u, r time.Duration
		legs := []func(){
			func() { f = stage(false); steps.MoveTo(&fencedSteps) },
			func() { u = stage(true); steps.MoveTo(&unfencedSteps) },
			func() { r = raw() },
		}
		for k := range legs {
			legs[(i+k)%len(legs)]()
		}
		if i == 0 {
			fencedSteps, unfencedSteps = csitest.StepTimes{}, csitest.StepTimes{}
			continue
		}
		fenced, unfenced, byHand = append(fenced, f), append(unfenced, u), append(byHand, r)
	}
	median := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)/2]
	}
	perRound := func(a, b []time.Duration) float64 {
		ratios := make([]float64, len(a))
		for i := range a {
			ratios[i] = float64(a[i]) / float64(b[i])
		}
		slices.Sort(ratios)
		return ratios[len(ratios)/2]
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond)) }
	t.Logf("BENCH nvmeof fencing (NVMe/TCP loopback, nvmet with reservations, ext4 64 MiB, TCG guest, median of %d):", iterations)
	t.Logf("BENCH   stage fenced %s, unfenced %s, raw kernel steps %s; fenced/unfenced: ratio of the medians %.2f, median of the per-round ratios %.2f (goal <= 1.05); fenced/raw %.2f, unfenced/raw %.2f",
		ms(median(fenced)), ms(median(unfenced)), ms(median(byHand)), float64(median(fenced))/float64(median(unfenced)), perRound(fenced, unfenced),
		perRound(fenced, byHand), perRound(unfenced, byHand))
	t.Logf("BENCH   berth steps, fenced stages, %s", fencedSteps.Summary())
	t.Logf("BENCH   berth steps, unfenced stages, %s", unfencedSteps.Summary())
	t.Logf("BENCH   single runs: fenced %v; unfenced %v; raw %v", fenced, unfenced, byHand)
}
