package bench_test

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/file"
	"github.com/berth-csi/berth/test/csitest"
)

// requireBench skips unless the benchmarks were asked for (BERTH_BENCH=1);
// asked for, a missing requirement is a failure.
func requireBench(t *testing.T, tools ...string) {
	t.Helper()
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1 (make bench)")
	}
	if os.Geteuid() != 0 {
		t.Fatal("BERTH_BENCH=1: needs root (loop devices, mounts)")
	}
	for _, tool := range tools {
		if _, err := lookTool(tool); err != nil {
			t.Fatalf("BERTH_BENCH=1: needs %s (make deps)", tool)
		}
	}
}

func lookTool(name string) (string, error) {
	for _, d := range []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found", name)
}

// node is an agent with the file transport rooted at root, served on a
// unix socket as `berth serve` does.
type node struct {
	agent *agent.Agent
	csi   csi.NodeClient
	root  string
	steps *csitest.StepTimes
}

func startNode(t *testing.T, dir string) *node {
	t.Helper()
	root := filepath.Join(dir, "images")
	if err := os.MkdirAll(root, 0o700); err != nil {
		t.Fatal(err)
	}
	steps := &csitest.StepTimes{}
	warn := slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelWarn})
	l := csitest.Listener(t)
	ft, err := file.New(root, l)
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Config{
		NodeID: "bench", StateDir: filepath.Join(dir, "state"), Logger: slog.New(steps.Handler(warn)),
		Listener:   l,
		Transports: []agent.Transport{agent.TransportFunc(agent.TransportKind{Name: file.Name, Keys: file.TransportKeys()}, ft.Parse)},
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
		cancel()
		<-done
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		cancel()
		<-done
		detachLoopsUnder(t, root)
	})
	return &node{agent: a, csi: csi.NewNodeClient(conn), root: root, steps: steps}
}

// detachLoopsUnder detaches, as a safety net, every loop device still
// backed by a file below dir, and says so.
func detachLoopsUnder(t *testing.T, dir string) {
	entries, _ := os.ReadDir("/sys/class/block")
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if d, err := (devices.Roots{}).Lookup(e.Name()); err == nil && strings.HasPrefix(d.ID.BackingFile, dir+"/") {
			t.Errorf("left %s attached to %s", d.ID.BackingFile, d.Path)
			_ = devices.DetachLoop(d)
		}
	}
}

// volume is a file volume of the node: a sparse image and a staging path.
type volume struct {
	id, image, staging string
}

func (n *node) newVolume(t *testing.T, name string, size int64) volume {
	t.Helper()
	v := volume{id: name, image: filepath.Join(n.root, name+".img"), staging: filepath.Join(filepath.Dir(n.root), "staging", name)}
	f, err := os.Create(v.image)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.MkdirAll(v.staging, 0o750); err != nil {
		t.Fatal(err)
	}
	return v
}

func (v volume) stageRequest() *csi.NodeStageVolumeRequest {
	return &csi.NodeStageVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: csitest.MountCap("ext4"),
		VolumeContext: map[string]string{file.KeyFile: filepath.Base(v.image)},
	}
}

func (n *node) stage(ctx context.Context, v volume) error {
	_, err := n.csi.NodeStageVolume(ctx, v.stageRequest())
	return err
}

func (n *node) unstage(ctx context.Context, v volume) error {
	_, err := n.csi.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	return err
}

// samples are the durations of one measured operation.
type samples []time.Duration

func (s samples) quantile(q float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	c := slices.Clone(s)
	slices.Sort(c)
	i := int(math.Ceil(q*float64(len(c)))) - 1
	return c[max(0, min(i, len(c)-1))]
}

func (s samples) median() time.Duration { return s.quantile(0.5) }

func ms(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', msDigits(d), 64) + " ms"
}

func msDigits(d time.Duration) int {
	switch {
	case d < time.Millisecond:
		return 3
	case d < 100*time.Millisecond:
		return 1
	}
	return 0
}

// verdict is "ok" or "OVER" for a ratio against its goal.
func verdict(ratio, goal float64) string {
	if ratio <= goal {
		return "ok"
	}
	return "OVER"
}

// hostLoad describes how busy the host was, for the report.
func hostLoad() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "load unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "load unknown"
	}
	return fmt.Sprintf("load average %s %s %s", f[0], f[1], f[2])
}

// cpuTimes is CPU time spent since boot: by the whole host (every CPU,
// kernel threads included), by this process, and by its waited-for
// children.
type cpuTimes struct{ host, self, children time.Duration }

func readCPU() cpuTimes {
	var c cpuTimes
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line)
		for i, v := range f[1:] {
			// user nice system idle iowait irq softirq steal: idle and
			// iowait are not busy.
			if i == 3 || i == 4 || i > 7 {
				continue
			}
			n, _ := strconv.ParseInt(v, 10, 64)
			c.host += time.Duration(n) * (time.Second / 100) // USER_HZ
		}
	}
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		c.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if unix.Getrusage(unix.RUSAGE_CHILDREN, &ru) == nil {
		c.children = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	return c
}

func (c cpuTimes) sub(o cpuTimes) cpuTimes {
	return cpuTimes{host: c.host - o.host, self: c.self - o.self, children: c.children - o.children}
}
