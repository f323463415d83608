package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/systemd"
)

func TestInflight(t *testing.T) {
	l := newInflight()
	unlockA, err := l.tryLock(volumeKey("a"), pathKey("/p"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.tryLock(volumeKey("a")); !errors.Is(err, errdefs.ErrBusy) {
		t.Fatalf("second lock of a busy volume: %v, want ErrBusy", err)
	}
	// All or nothing: b is free but /p is held, so b must stay free.
	if _, err := l.tryLock(volumeKey("b"), pathKey("/p")); !errors.Is(err, errdefs.ErrBusy) {
		t.Fatalf("lock of a busy path: %v, want ErrBusy", err)
	}
	unlockB, err := l.tryLock(volumeKey("b"), volumeKey("b"))
	if err != nil {
		t.Fatalf("b must be free after a failed all-or-nothing lock: %v", err)
	}
	unlockA()
	unlockB()
	if _, err := l.tryLock(volumeKey("a"), volumeKey("b"), pathKey("/p")); err != nil {
		t.Fatalf("keys not released: %v", err)
	}
}

func stageReq(id, staging, key string) *csi.NodeStageVolumeRequest {
	return &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: mountCap("ext4", snw),
		VolumeContext:    map[string]string{"transport": "fake", "fake": key},
	}
}

// A call for a volume with an operation in flight is answered Aborted at
// once; calls for other volumes go on in parallel; a volume is never
// mounted twice.
func TestBusyVolumeIsAborted(t *testing.T) {
	a, host, tr := newFakeAgent(t)
	n := &nodeServer{a: a}
	ctx := context.Background()
	dir := t.TempDir()
	stagingA, stagingB := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, d := range []string{stagingA, stagingB} {
		must(t, "mkdir", mkdirAll(d))
	}

	release := tr.hold("1")
	done := make(chan error, 1)
	go func() {
		_, err := n.NodeStageVolume(ctx, stageReq("vol-a", stagingA, "1"))
		done <- err
	}()
	select {
	case <-tr.entered: // vol-a is inside Attach, holding its lock
	case err := <-done:
		t.Fatalf("stage of vol-a returned before Attach: %v", err)
	}

	start := time.Now()
	_, err := n.NodeStageVolume(ctx, stageReq("vol-a", stagingA, "1"))
	wantCode(t, "stage of a busy volume", err, codes.Aborted)
	_, err = n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol-a", StagingTargetPath: stagingA})
	wantCode(t, "unstage of a busy volume", err, codes.Aborted)
	_, err = n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "vol-a", VolumePath: stagingA})
	wantCode(t, "stats of a busy volume", err, codes.Aborted)
	_, err = n.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "vol-a", VolumePath: stagingA})
	wantCode(t, "expand of a busy volume", err, codes.Aborted)
	_, err = n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "vol-a", StagingTargetPath: stagingA, TargetPath: filepath.Join(dir, "t"), VolumeCapability: mountCap("ext4", snw)})
	wantCode(t, "publish of a busy volume", err, codes.Aborted)
	_, err = n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "vol-a", TargetPath: filepath.Join(dir, "t")})
	wantCode(t, "unpublish of a busy volume", err, codes.Aborted)
	// Another volume on the busy staging path is refused too.
	_, err = n.NodeStageVolume(ctx, stageReq("vol-c", stagingA, "3"))
	wantCode(t, "stage on a busy path", err, codes.Aborted)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("busy answers took %v; they must not wait", d)
	}

	// vol-b is independent and completes while vol-a is stuck.
	_, err = n.NodeStageVolume(ctx, stageReq("vol-b", stagingB, "2"))
	must(t, "stage of another volume", err)
	<-tr.entered

	release()
	must(t, "stage of vol-a", <-done)

	// A storm of duplicate calls: each is OK or Aborted, and the
	// staging path is mounted exactly once.
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := n.NodeStageVolume(ctx, stageReq("vol-a", stagingA, "1"))
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if c := status.Code(err); c != codes.OK && c != codes.Aborted {
			t.Fatalf("duplicate stage: %v", err)
		}
	}
	if c := host.mountCount(stagingA); c != 1 {
		t.Fatalf("staging path mounted %d times, want 1", c)
	}
}

// Parallel stages of a volume that is not yet staged never mount twice:
// exactly one wins, the others are Aborted or find it staged.
func TestConcurrentFirstStageMountsOnce(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	var wg sync.WaitGroup
	var mu sync.Mutex
	codesSeen := map[codes.Code]int{}
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := n.NodeStageVolume(context.Background(), stageReq("vol", staging, "7"))
			mu.Lock()
			codesSeen[status.Code(err)]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	if codesSeen[codes.OK] == 0 || codesSeen[codes.OK]+codesSeen[codes.Aborted] != 16 {
		t.Fatalf("answers %v, want only OK and Aborted", codesSeen)
	}
	if c := host.mountCount(staging); c != 1 {
		t.Fatalf("mounted %d times, want 1", c)
	}
}

// The log line of a finished stage says how long each step took.
func TestStageLogsStepTimes(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	// The stage logs from this goroutine: a plain buffer will do.
	var buf bytes.Buffer
	a.log = slog.New(systemd.NewLogHandler(&buf, nil))
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	if _, err := n.NodeStageVolume(context.Background(), stageReq("vol-t", staging, "7")); err != nil {
		t.Fatal(err)
	}
	// Durations are seconds, as everywhere in berth's JSON logs.
	var line struct {
		Msg  string             `json:"msg"`
		Took map[string]float64 `json:"took"`
	}
	found := false
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if err := json.Unmarshal([]byte(l), &line); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if line.Msg != "staged" {
			continue
		}
		found = true
		for _, step := range []string{"prepare", "attach", "verify", "format", "verify_again", "mount", "record", "total"} {
			if v, ok := line.Took[step]; !ok || v < 0 || v > line.Took["total"] {
				t.Errorf("took.%s = %v (present %v), want seconds between 0 and the total %v", step, v, ok, line.Took["total"])
			}
		}
	}
	if !found {
		t.Fatalf("no staged line in:\n%s", buf.String())
	}
}

// The log line of an expansion gives the size before and after, in bytes.
func TestExpandLogsSizes(t *testing.T) {
	a, _, tr := newFakeAgent(t)
	var buf bytes.Buffer
	a.log = slog.New(systemd.NewLogHandler(&buf, nil))
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	_, err := n.NodeStageVolume(context.Background(), stageReq("vol-x", staging, "7"))
	must(t, "stage", err)
	tr.mu.Lock()
	tr.grownTo = 3 << 20
	tr.mu.Unlock()
	resp, err := n.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{VolumeId: "vol-x", VolumePath: staging})
	must(t, "expand", err)
	if resp.GetCapacityBytes() != 3<<20 {
		t.Fatalf("capacity %d, want %d", resp.GetCapacityBytes(), 3<<20)
	}
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var line struct {
			Msg string `json:"msg"`
			Old int64  `json:"old_bytes"`
			New int64  `json:"new_bytes"`
		}
		if err := json.Unmarshal([]byte(l), &line); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if line.Msg == "expanded" {
			if line.Old != 1<<20 || line.New != 3<<20 {
				t.Fatalf("expanded line %s: want old_bytes %d, new_bytes %d", l, 1<<20, 3<<20)
			}
			return
		}
	}
	t.Fatalf("no expanded line in:\n%s", buf.String())
}
