package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
)

// outageAgent stages volume "vol" (fake key "4") and takes every path of
// its storage down, as a switch failover or a target restart does.
func outageAgent(t *testing.T) (*nodeServer, *fakeFS, *fakeTransport, string) {
	t.Helper()
	a, host, tr := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	if _, err := n.NodeStageVolume(context.Background(), stageReq("vol", staging, "4")); err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	tr.pathsDown["4"], tr.unreachable["4"] = true, true
	tr.mu.Unlock()
	return n, host, tr, staging
}

func setGrace(t *testing.T, d time.Duration) {
	old, oldPoll := pathGrace, pathPoll
	pathGrace, pathPoll = d, 20*time.Millisecond
	t.Cleanup(func() { pathGrace, pathPoll = old, oldPoll })
}

// An unstage that starts during a short outage waits for a path with
// the device still queueing, and then unmounts, flushes and detaches as
// usual: nothing the kernel would have written a moment later is lost.
func TestUnstageDuringShortOutageWaitsForPath(t *testing.T) {
	setGrace(t, 10*time.Second)
	n, host, tr, staging := outageAgent(t)
	go func() {
		time.Sleep(300 * time.Millisecond)
		tr.mu.Lock()
		tr.pathsDown["4"], tr.unreachable["4"] = false, false
		tr.mu.Unlock()
	}()
	start := time.Now()
	if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 250*time.Millisecond || took > 5*time.Second {
		t.Errorf("unstage took %v: want it to wait for the path (300 ms), and no longer", took)
	}
	want := []string{"unmount " + staging, "flush /dev/fake250-4"}
	if got := host.eventLog(); !slices.Equal(got, want) {
		t.Errorf("steps %q, want %q: the device must not be made to fail I/O", got, want)
	}
	if tr.detached["4"] != 1 {
		t.Errorf("Detach %d times, want 1", tr.detached["4"])
	}
}

// When no path comes back within the grace, the device is made to fail
// I/O before the unmount, as before.
func TestUnstageDuringLongOutageStopsQueueing(t *testing.T) {
	setGrace(t, 200*time.Millisecond)
	n, host, tr, staging := outageAgent(t)
	if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	want := []string{"stop queueing 4", "unmount " + staging}
	if got := host.eventLog(); !slices.Equal(got, want) {
		t.Errorf("steps %q, want %q", got, want)
	}
	if tr.stopped["4"] != 1 {
		t.Errorf("StopQueueing %d times, want 1", tr.stopped["4"])
	}
	// The wait takes at most half the request's remaining time.
	setGrace(t, time.Hour)
	n, _, _, staging = outageAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	_, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging})
	if took := time.Since(start); err != nil || took < 900*time.Millisecond || took > 1800*time.Millisecond {
		t.Errorf("unstage with a 2 s deadline during an outage: %v after %v; want OK after a wait of about 1 s", err, took)
	}
}

// A filesystem also mounted elsewhere (a bind of the staging path that
// leaked into another mount) keeps its disk: the unstage during an outage
// answers ABORTED naming the mount, and the device keeps queueing.
func TestUnstageDuringOutageKeepsLeakedMount(t *testing.T) {
	setGrace(t, 50*time.Millisecond)
	n, host, tr, staging := outageAgent(t)
	host.mu.Lock()
	host.mounts["/leaked/bind"] = host.mounts[staging]
	host.mu.Unlock()
	_, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging})
	if status.Code(err) != codes.Aborted || !strings.Contains(err.Error(), "/leaked/bind") {
		t.Fatalf("unstage with a leaked mount during an outage: %v, want Aborted naming /leaked/bind", err)
	}
	if tr.stopped["4"] != 0 || !host.mounted(staging) {
		t.Errorf("StopQueueing %d times, staging mounted %v: want 0 and mounted", tr.stopped["4"], host.mounted(staging))
	}
	if _, ok := n.a.state.get("vol"); !ok {
		t.Error("record dropped")
	}
}

// An unstage that made the device fail I/O and then did not finish (an
// unmount refused as busy) gives the device its queueing back: the volume
// stays staged, and the next outage must not fail its I/O at once.
func TestUnstageNotFinishedResumesQueueing(t *testing.T) {
	setGrace(t, 100*time.Millisecond)
	n, host, tr, staging := outageAgent(t)
	host.mu.Lock()
	host.unmountErr = fmt.Errorf("unmount %s: %w", staging, errdefs.ErrBusy)
	host.mu.Unlock()
	_, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging})
	if err == nil {
		t.Fatal("unstage with a busy staging mount: OK, want an error")
	}
	want := []string{"stop queueing 4", "unmount " + staging, "resume queueing 4"}
	if got := host.eventLog(); !slices.Equal(got, want) {
		t.Errorf("steps %q, want %q", got, want)
	}
	if _, ok := n.a.state.get("vol"); !ok {
		t.Error("record dropped")
	}
	if n := tr.resumedCount("4"); n != 1 {
		t.Errorf("ResumeQueueing %d times, want 1", n)
	}

	// The retry, with the mount no longer busy, finishes: queueing is not
	// given back to a device that is gone.
	host.mu.Lock()
	host.unmountErr, host.events = nil, nil
	host.mu.Unlock()
	if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	want = []string{"stop queueing 4", "unmount " + staging}
	if got := host.eventLog(); !slices.Equal(got, want) {
		t.Errorf("retry: steps %q, want %q", got, want)
	}
}

// An unmount still waiting in the kernel at the deadline goes on in the
// background: queueing comes back only after it ended, since a device
// that queued again would hold that unmount until a path returns.
func TestUnstageLeftRunningResumesQueueingAfterIt(t *testing.T) {
	setGrace(t, 50*time.Millisecond)
	n, host, tr, staging := outageAgent(t)
	gate := make(chan struct{})
	host.mu.Lock()
	host.unmountGate = gate
	host.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}); status.Code(err) != codes.Unavailable {
		t.Fatalf("unstage with the unmount held past the deadline: %v, want Unavailable", err)
	}
	if n := tr.resumedCount("4"); n != 0 {
		t.Fatalf("ResumeQueueing %d times while the unmount still waits, want 0", n)
	}
	host.mu.Lock()
	host.unmountErr = fmt.Errorf("unmount %s: %w", staging, errdefs.ErrBusy)
	host.mu.Unlock()
	close(gate)
	deadline := time.Now().Add(5 * time.Second)
	for tr.resumedCount("4") == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := tr.resumedCount("4"); n != 1 {
		t.Errorf("ResumeQueueing %d times after the unmount ended, want 1", n)
	}
}
