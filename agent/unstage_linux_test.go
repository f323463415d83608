package agent

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// An unmount that blocks in the kernel (its device queues I/O) does not
// hold the RPC past its deadline: unstage answers Unavailable at the
// deadline, the volume answers Aborted while the unmount goes on, and the
// retry after it ended finishes the unstage.
func TestUnstageBlockedUnmountReturnsAtDeadline(t *testing.T) {
	a, host, tr := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	if _, err := n.NodeStageVolume(context.Background(), stageReq("vol", staging, "3")); err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	host.mu.Lock()
	host.unmountGate = gate
	host.mu.Unlock()
	released := false
	defer func() {
		if !released {
			close(gate)
		}
	}()
	req := &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := n.NodeUnstageVolume(ctx, req)
	if el := time.Since(start); el > time.Second {
		t.Fatalf("unstage returned after %v, past its 200ms deadline", el)
	}
	wantCode(t, "unstage with the unmount blocked", err, codes.Unavailable)
	if !strings.Contains(err.Error(), "unmount "+staging) {
		t.Errorf("the error does not say which step is blocked: %v", err)
	}
	_, err = n.NodeUnstageVolume(context.Background(), req)
	wantCode(t, "unstage while the unmount goes on", err, codes.Aborted)
	if tr.detached["3"] != 0 {
		t.Fatal("detached under a mount")
	}

	close(gate)
	released = true
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err = n.NodeUnstageVolume(context.Background(), req)
		if err == nil {
			break
		}
		wantCode(t, "unstage retry", err, codes.Aborted)
		if time.Now().After(deadline) {
			t.Fatalf("unstage retry still refused: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if host.mounted(staging) {
		t.Error("staging path still mounted")
	}
	if tr.detached["3"] != 1 {
		t.Errorf("detached %d times, want 1", tr.detached["3"])
	}
	if _, ok := a.state.get("vol"); ok {
		t.Error("record left")
	}
}

// A target none of whose paths works is told to stop queueing before the
// staging mount is unmounted, and its device is not flushed (a flush
// could only fail); a reachable one is flushed after the unmount.
func TestUnstageStopsQueueingBeforeUnmount(t *testing.T) {
	for _, unreachable := range []bool{false, true} {
		a, host, tr := newFakeAgent(t)
		n := &nodeServer{a: a}
		staging := filepath.Join(t.TempDir(), "s")
		must(t, "mkdir", mkdirAll(staging))
		if _, err := n.NodeStageVolume(context.Background(), stageReq("vol", staging, "4")); err != nil {
			t.Fatal(err)
		}
		tr.mu.Lock()
		tr.unreachable["4"] = unreachable
		tr.mu.Unlock()
		if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
		want := []string{"unmount " + staging, "flush /dev/fake250-4"}
		if unreachable {
			want = []string{"stop queueing 4", "unmount " + staging}
		}
		if got := host.eventLog(); !slices.Equal(got, want) {
			t.Errorf("unreachable %v: steps %q, want %q", unreachable, got, want)
		}
		if tr.stopped["4"] != 1 || tr.detached["4"] != 1 {
			t.Errorf("unreachable %v: StopQueueing %d times, Detach %d times, want 1 each", unreachable, tr.stopped["4"], tr.detached["4"])
		}
	}
}

// An image deleted while staged still has its loop device detached at
// unstage.
func TestUnstageDeletedImage(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("gone", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	img := filepath.Join(h.root, "gone.img")
	d, err := devices.Roots{}.FindLoop(img)
	must(t, "find loop", err)
	must(t, "delete image", os.Remove(img))
	st, err := h.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.staging})
	must(t, "stats", err)
	if !st.GetVolumeCondition().GetAbnormal() {
		t.Fatalf("deleted image reported healthy: %v", st.GetVolumeCondition())
	}
	must(t, "unstage", h.unstage(v))
	if cur, err := (devices.Roots{}).Lookup(d.Name); err == nil && cur.ID.BackingFile != "" && strings.HasPrefix(cur.ID.BackingFile, img) {
		t.Fatalf("%s still backed by %q after unstage", d.Path, cur.ID.BackingFile)
	}
}
