package bench_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// concurrentGoal is the most that staging N volumes at once may take
// relative to running the same kernel steps for them at once.
const concurrentGoal = 1.15

// TestBenchConcurrentStage stages N new file volumes (ext4, 64 MiB) at
// once through the agent and compares the wall time with the same N
// attach, mkfs and mount steps run at once with losetup, mkfs.ext4 and
// mount, round by round in one run. A stage that fails fails the
// benchmark.
func TestBenchConcurrentStage(t *testing.T) {
	requireBench(t, "losetup", "mkfs.ext4", "mount", "umount")
	// A round of 1 or 8 stages lasts tens of milliseconds, which the
	// host's own noise moves by a tenth; 15 rounds steady the median.
	rounds := envInt("BERTH_BENCH_ROUNDS", 15)
	counts := []int{1, 8, 32}
	if s := os.Getenv("BERTH_BENCH_COUNTS"); s != "" {
		counts = nil
		for _, f := range strings.Split(s, ",") {
			if c, err := strconv.Atoi(f); err == nil && c > 0 {
				counts = append(counts, c)
			}
		}
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()

	type result struct {
		berth, raw       samples
		berthCPU, rawCPU []cpuTimes
		steps            string
	}
	results := make(map[int]*result)
	seq := 0
	for _, count := range counts {
		r := &result{}
		results[count] = r
		// A node per N, so that its step times are N's alone.
		n := startNode(t, filepath.Join(dir, strconv.Itoa(count)))
		for round := range rounds {
			seq++
			// The order alternates, so that a drift of the host's load
			// favours neither side.
			first, second := "berth", "raw"
			if round%2 == 1 {
				first, second = second, first
			}
			for _, side := range []string{first, second} {
				vols := make([]volume, count)
				for i := range vols {
					vols[i] = n.newVolume(t, fmt.Sprintf("c%d-%s-%d", seq, side, i), 64<<20)
				}
				if side == "berth" {
					d, cpu := berthStage(t, ctx, n, vols)
					r.berth, r.berthCPU = append(r.berth, d), append(r.berthCPU, cpu)
				} else {
					d, cpu := rawStage(t, ctx, vols)
					r.raw, r.rawCPU = append(r.raw, d), append(r.rawCPU, cpu)
				}
				for _, v := range vols {
					os.Remove(v.image)
				}
			}
		}
		r.steps = n.steps.Summary()
	}
	t.Logf("BENCH host: N NodeStageVolume at once of new file volumes (ext4, 64 MiB sparse images, mkfs included) vs N of losetup on a free loop device chosen beforehand + mkfs.ext4 + mount at once; %d cores, %s, median of %d rounds",
		runtime.NumCPU(), hostLoad(), rounds)
	for _, count := range counts {
		r := results[count]
		ratios := make([]float64, len(r.berth))
		for i := range ratios {
			ratios[i] = float64(r.berth[i]) / float64(r.raw[i])
		}
		slices.Sort(ratios)
		ratio := ratios[len(ratios)/2]
		t.Logf("BENCH   N=%-2d  berth %8s  raw %8s  berth/raw %.2f (goal <= %.2f) %s   per volume: berth %s, raw %s",
			count, ms(r.berth.median()), ms(r.raw.median()), ratio, concurrentGoal, verdict(ratio, concurrentGoal),
			ms(r.berth.median()/time.Duration(count)), ms(r.raw.median()/time.Duration(count)))
	}
	if one := results[1]; one != nil {
		for _, count := range counts[1:] {
			t.Logf("BENCH   N=%-2d  takes %.1fx one alone with berth, %.1fx with the raw steps",
				count, float64(results[count].berth.median())/float64(one.berth.median()),
				float64(results[count].raw.median())/float64(one.raw.median()))
		}
	}
	for _, count := range counts {
		r := results[count]
		b, w := sumCPU(r.berthCPU), sumCPU(r.rawCPU)
		// The host's figure counts in 10 ms ticks: summed over the
		// rounds, not a median of each round's few ticks.
		per := func(d time.Duration) string { return ms(d / time.Duration(count*len(r.berthCPU))) }
		t.Logf("BENCH   N=%-2d  CPU per volume (all rounds): berth %s (agent %s, its programs %s, kernel threads and the rest %s), raw %s (test %s, programs %s, rest %s)",
			count, per(b.host), per(b.self), per(b.children), per(b.host-b.self-b.children),
			per(w.host), per(w.self), per(w.children), per(w.host-w.self-w.children))
	}
	for _, count := range counts {
		t.Logf("BENCH   N=%-2d  berth steps, %s", count, results[count].steps)
	}
}

// berthStage stages vols at once, checks that every stage succeeded,
// unstages them and returns the wall time of the stages.
func berthStage(t *testing.T, ctx context.Context, n *node, vols []volume) (time.Duration, cpuTimes) {
	t.Helper()
	errs := make([]error, len(vols))
	var wg sync.WaitGroup
	cpu0, start := readCPU(), time.Now()
	for i, v := range vols {
		wg.Go(func() { errs[i] = n.stage(ctx, v) })
	}
	wg.Wait()
	d, cpu := time.Since(start), readCPU().sub(cpu0)
	failed := 0
	for i, err := range errs {
		if err != nil {
			failed++
			t.Errorf("stage %s: %v", vols[i].id, err)
		}
	}
	for i, v := range vols {
		if errs[i] == nil {
			if err := n.unstage(ctx, v); err != nil {
				t.Errorf("unstage %s: %v", v.id, err)
			}
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d concurrent stages failed", failed, len(vols))
	}
	return d, cpu
}

// rawStage runs, for each volume at once, losetup on a free loop device
// chosen beforehand, mkfs.ext4 with the options berth gives it, and
// mount; it undoes them afterwards and returns the wall time of the
// steps. The devices are chosen before the clock starts because losetup
// --find, when another losetup took the same free device first, sleeps
// 200 ms before it asks again: the raw steps are the kernel's, without
// the allocation's cost.
func rawStage(t *testing.T, ctx context.Context, vols []volume) (time.Duration, cpuTimes) {
	t.Helper()
	losetup, _ := lookTool("losetup")
	mkfs, _ := lookTool("mkfs.ext4")
	mount, _ := lookTool("mount")
	loops := freeLoops(t, len(vols))
	attached := make([]bool, len(vols))
	errs := make([]error, len(vols))
	var wg sync.WaitGroup
	cpu0, start := readCPU(), time.Now()
	for i, v := range vols {
		wg.Go(func() {
			if err := exec.CommandContext(ctx, losetup, loops[i], v.image).Run(); err != nil {
				// Another process on the node took the device since it
				// was chosen: let losetup find one, as it would by hand.
				out, err := exec.CommandContext(ctx, losetup, "--find", "--show", v.image).CombinedOutput()
				if err != nil {
					errs[i] = fmt.Errorf("losetup: %v: %s", err, out)
					return
				}
				loops[i] = strings.TrimSpace(string(out))
			}
			attached[i] = true
			if out, err := exec.CommandContext(ctx, mkfs, "-q", "-t", "ext4", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", loops[i]).CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("mkfs.ext4: %v: %s", err, out)
				return
			}
			if out, err := exec.CommandContext(ctx, mount, "-t", "ext4", loops[i], v.staging).CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("mount: %v: %s", err, out)
			}
		})
	}
	wg.Wait()
	d, cpu := time.Since(start), readCPU().sub(cpu0)
	for i, v := range vols {
		if errs[i] != nil {
			t.Errorf("raw steps for %s: %v", v.id, errs[i])
		}
		_ = syscall.Unmount(v.staging, 0)
		if attached[i] {
			if out, err := exec.Command(losetup, "-d", loops[i]).CombinedOutput(); err != nil {
				t.Errorf("losetup -d %s: %v: %s", loops[i], err, out)
			}
		}
	}
	// The last close of an unmounted filesystem's device may come after
	// umount returns; the detach waits for it.
	for i := range vols {
		if attached[i] {
			waitUnbound(t, loops[i])
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return d, cpu
}

// sumCPU is the sum of cs.
func sumCPU(cs []cpuTimes) cpuTimes {
	var sum cpuTimes
	for _, c := range cs {
		sum.host, sum.self, sum.children = sum.host+c.host, sum.self+c.self, sum.children+c.children
	}
	return sum
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// freeLoops returns n loop devices that are unbound now, creating them
// through loop-control when fewer exist.
func freeLoops(t *testing.T, n int) []string {
	t.Helper()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	var out []string
	for i := 0; len(out) < n; i++ {
		name := "loop" + strconv.Itoa(i)
		if _, err := os.Stat("/sys/class/block/" + name); err != nil {
			if err := unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_ADD, i); err != nil && !errors.Is(err, unix.EEXIST) {
				t.Fatalf("LOOP_CTL_ADD %d: %v", i, err)
			}
		} else if _, err := os.Stat("/sys/class/block/" + name + "/loop"); err == nil {
			continue // bound
		}
		out = append(out, "/dev/"+name)
	}
	return out
}

// waitUnbound waits, briefly, until the loop device dev has no backing
// file.
func waitUnbound(t *testing.T, dev string) {
	t.Helper()
	sys := "/sys/class/block/" + filepath.Base(dev) + "/loop"
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(sys); err != nil {
			return
		}
	}
	t.Errorf("%s still bound 5s after losetup -d", dev)
}
