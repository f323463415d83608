package agent

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/devices"
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

// loopAutoclear reports whether the kernel will detach the loop device at
// its last close (autoclear), as its sysfs attribute says.
func loopAutoclear(t *testing.T, dev string) bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "autoclear"))
	must(t, "read autoclear of "+dev, err)
	return strings.TrimSpace(string(b)) == "1"
}

// loopBacking returns the backing file the kernel shows for the loop
// device dev, "" when it is not bound.
func loopBacking(t *testing.T, dev string) string {
	t.Helper()
	d, err := devices.Roots{}.Lookup(filepath.Base(dev))
	if err != nil {
		return ""
	}
	return d.ID.BackingFile
}

// An image replaced, while staged, by a symbolic link to a file outside
// the file root that has a loop device of its own: unstage detaches the
// loop device berth attached at stage, and never touches the other one
// (not detached, no autoclear set on it, held open or not).
func TestUnstageImageReplacedBySymlink(t *testing.T) {
	for _, held := range []bool{false, true} {
		t.Run(map[bool]string{false: "idle", true: "held"}[held], func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("a", 64*mib, blockCap(snw))
			must(t, "stage", h.stage(v))
			rec, ok := h.recordOf(v.id)
			if !ok || rec.Device == nil {
				t.Fatal("no device recorded at stage")
			}
			ours := rec.Device.Path
			outside := filepath.Join(h.mkdir("outside"), "other.img")
			must(t, "create the other file", os.WriteFile(outside, make([]byte, 1<<20), 0o600))
			theirs := losetup(t, outside)
			if held {
				f, err := os.Open(theirs)
				must(t, "hold "+theirs, err)
				t.Cleanup(func() { f.Close() })
			}
			img := filepath.Join(h.root, "a.img")
			must(t, "remove image", os.Remove(img))
			must(t, "symlink", os.Symlink(outside, img))

			err := h.unstage(v)
			if got := loopBacking(t, theirs); got != outside {
				t.Errorf("unstage (%v) detached %s, the loop device of %s, which berth did not attach (backing now %q)", err, theirs, outside, got)
			} else if loopAutoclear(t, theirs) {
				t.Errorf("unstage (%v) set autoclear on %s, the loop device of %s, which berth did not attach", err, theirs, outside)
			}
			must(t, "unstage", err)
			// The number may be another attach's by now (a loop device
			// freed is the next losetup's): only its backing file says
			// whether it is still berth's.
			if got := loopBacking(t, ours); strings.HasPrefix(got, img) {
				t.Errorf("berth's loop device %s still attached to %q after unstage", ours, got)
			}
			if _, ok := h.recordOf(v.id); ok {
				t.Error("record left")
			}
		})
	}
}

// An image renamed (inside the root) while staged: unstage finds the loop
// device stage recorded, by its number and its backing inode, and
// detaches it; nothing leaks.
func TestUnstageRenamedImage(t *testing.T) {
	for _, block := range []bool{false, true} {
		name, c := "mount", mountCap("ext4", snw)
		if block {
			name, c = "block", blockCap(snw)
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("a", 64*mib, c)
			must(t, "stage", h.stage(v))
			rec, ok := h.recordOf(v.id)
			if !ok || rec.Device == nil {
				t.Fatal("no device recorded at stage")
			}
			moved := filepath.Join(h.root, "moved.img")
			must(t, "rename image", os.Rename(filepath.Join(h.root, "a.img"), moved))
			must(t, "unstage", h.unstage(v))
			if got := loopBacking(t, rec.Device.Path); strings.HasPrefix(got, moved) {
				t.Errorf("loop device %s leaked: still attached to %q after unstage", rec.Device.Path, got)
			}
			if !block && mountsAt(t, v.staging) != 0 {
				t.Error("staging path still mounted")
			}
			if _, ok := h.recordOf(v.id); ok {
				t.Error("record left")
			}
		})
	}
}

// A record whose volume_context was changed on disk (the state file
// edited) so that it names other storage than the one staged: unstage
// refuses (FailedPrecondition) and detaches neither, rather than tear
// down whatever the context names now and drop the record of what is
// still attached.
func TestUnstageRecordContextChanged(t *testing.T) {
	a, _, tr := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	if _, err := n.NodeStageVolume(context.Background(), stageReq("vol", staging, "3")); err != nil {
		t.Fatal(err)
	}
	rec, ok := a.state.get("vol")
	if !ok {
		t.Fatal("no record")
	}
	rec.Context["fake"] = "7"
	must(t, "edit record", a.state.put(rec))
	_, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging})
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("unstage of an edited record: got %v (%v), want FailedPrecondition", status.Code(err), err)
	}
	t.Log(err)
	if tr.detached["7"] != 0 || tr.detached["3"] != 0 {
		t.Errorf("detached %v (by key), want none", tr.detached)
	}
	if _, ok := a.state.get("vol"); !ok {
		t.Error("record of the staged volume dropped")
	}
}
