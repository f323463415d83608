package agent

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
	ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging})
	if err != nil || time.Since(start) > 390*time.Millisecond {
		t.Errorf("unstage with a 400 ms deadline during an outage: %v after %v; want OK within it", err, time.Since(start))
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
