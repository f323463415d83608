package agent

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// allocated is the space the file p takes on its filesystem.
func allocated(t *testing.T, p string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// fillAndDelete writes size bytes to a file in dir, syncs it, deletes it
// and syncs again, so that its blocks are free and committed: what a
// trim is for.
func fillAndDelete(t *testing.T, dir string, size int) {
	t.Helper()
	p := filepath.Join(dir, "big")
	f, err := os.Create(p)
	must(t, "create", err)
	chunk := bytes.Repeat([]byte("berth trim "), mib/11+1)[:mib]
	for range size / mib {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	must(t, "fsync", f.Sync())
	must(t, "close", f.Close())
	must(t, "remove", os.Remove(p))
	syscall.Sync()
}

func trimOne(t *testing.T, h *harness, id string) TrimResult {
	t.Helper()
	rs, err := TrimVolumes(context.Background(), h.stateDir, []string{id})
	must(t, "TrimVolumes", err)
	if len(rs) != 1 || rs[0].VolumeID != id {
		t.Fatalf("TrimVolumes(%s): %+v", id, rs)
	}
	return rs[0]
}

// A file written, synced and deleted on a file volume stays allocated in
// the image until the trim: the loop device punches the discarded
// ranges out of the image file.
func TestTrimGivesSpaceBack(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("trim", 256*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	img := filepath.Join(h.root, v.vctx["file"])
	const size = 128 * mib
	fillAndDelete(t, v.target, size)
	before := allocated(t, img)
	res := trimOne(t, h, v.id)
	if res.Err != nil || res.Skipped != "" || res.Trimmed == 0 {
		t.Fatalf("trim: %+v", res)
	}
	after := allocated(t, img)
	t.Logf("image %s: %d bytes allocated before the trim, %d after (%d given back of a %d-byte file deleted); FITRIM reported %d bytes",
		filepath.Base(img), before, after, before-after, size, res.Trimmed)
	if before-after < size*8/10 {
		t.Fatalf("the trim gave back %d bytes of the %d-byte file deleted", before-after, size)
	}
	must(t, "unpublish", h.unpublish(v))
	must(t, "unstage", h.unstage(v))
	if _, err := os.Stat(filepath.Join(trimLockDir(h.stateDir), strings.TrimSuffix(stateFileName(v.id), ".json")+".lock")); !os.IsNotExist(err) {
		t.Fatalf("trim lock file after unstage: %v", err)
	}
	res = trimOne(t, h, v.id)
	if res.Err == nil {
		t.Fatalf("trim of an unstaged volume: %+v", res)
	}
}

// Raw block and read-only volumes are skipped and say why; a volume whose
// trim lock another process holds is skipped as busy, and its unstage
// waits (Aborted) for the trim.
func TestTrimSkips(t *testing.T) {
	h := newHarness(t)
	blk := h.newVol("blk", 64*mib, blockCap(snw))
	must(t, "stage block", h.stage(blk))
	ro := h.newVol("ro", 64*mib, mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY))
	must(t, "stage reader-only", h.stage(ro))
	rw := h.newVol("rw", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(rw))

	// As another berth trim would: its own open file, its own flock.
	l, err := lockTrim(h.stateDir, rw.id)
	if err != nil || l == nil {
		t.Fatalf("lockTrim: %v, %v", l, err)
	}
	rs, err := TrimVolumes(context.Background(), h.stateDir, nil)
	must(t, "TrimVolumes --all", err)
	got := map[string]TrimResult{}
	for _, r := range rs {
		got[r.VolumeID] = r
		t.Logf("%s: trimmed %d, skipped %q, err %v", r.VolumeID, r.Trimmed, r.Skipped, r.Err)
	}
	for id, want := range map[string]string{blk.id: "raw block", ro.id: "read-only", rw.id: trimBusy} {
		if r := got[id]; r.Err != nil || !strings.Contains(r.Skipped, want) {
			t.Errorf("%s: %+v, want skipped: %s", id, r, want)
		}
	}
	_, err = h.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: rw.id, StagingTargetPath: rw.staging})
	wantCode(t, "unstage during a trim", err, codes.Aborted)
	must(t, "release", l.Close())
	if r := trimOne(t, h, rw.id); r.Err != nil || r.Skipped != "" {
		t.Fatalf("trim once the lock is free: %+v", r)
	}
	for _, v := range []vol{blk, ro, rw} {
		must(t, "unstage "+v.id, h.unstage(v))
	}
}

// berth serve --trim-interval trims each staged volume in its turn.
func TestPeriodicTrim(t *testing.T) {
	results := make(chan TrimResult, 16)
	h := newHarness(t, func(c *Config) {
		c.TrimInterval = time.Second
		c.OnTrim = func(r TrimResult) {
			select {
			case results <- r:
			default:
			}
		}
	})
	v := h.newVol("periodic", 128*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	img := filepath.Join(h.root, v.vctx["file"])
	const size = 64 * mib
	fillAndDelete(t, v.target, size)
	before := allocated(t, img)
	deadline := time.After(20 * time.Second)
	for done := false; !done; {
		select {
		case r := <-results:
			t.Logf("periodic trim: %+v", r)
			if r.VolumeID != v.id || r.Err != nil {
				t.Fatalf("periodic trim: %+v", r)
			}
			done = r.Trimmed > 0
		case <-deadline:
			t.Fatal("no periodic trim within 20s of a 1s interval")
		}
	}
	after := allocated(t, img)
	t.Logf("image: %d bytes allocated before, %d after the periodic trim", before, after)
	if before-after < size*8/10 {
		t.Fatalf("the periodic trim gave back %d bytes of the %d-byte file deleted", before-after, size)
	}
	must(t, "unpublish", h.unpublish(v))
	// Unstage may meet the trim of the next turn: Aborted, retried.
	for i := 0; ; i++ {
		_, err := h.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
		if err == nil {
			break
		}
		wantCode(t, "unstage", err, codes.Aborted)
		if i == 20 {
			t.Fatalf("unstage still Aborted after %d tries: %v", i, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The periodic trim gives raw block and read-only volumes no turn: they
// are never trimmed, and count in no metric.
func TestPeriodicTrimLeavesIneligible(t *testing.T) {
	results := make(chan TrimResult, 16)
	h := newHarness(t, func(c *Config) {
		c.TrimInterval = 200 * time.Millisecond
		c.OnTrim = func(r TrimResult) { results <- r }
	})
	blk := h.newVol("blk", 64*mib, blockCap(snw))
	must(t, "stage block", h.stage(blk))
	ro := h.newVol("ro", 64*mib, mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY))
	must(t, "stage reader-only", h.stage(ro))
	select {
	case r := <-results:
		t.Fatalf("a periodic trim of an ineligible volume: %+v", r)
	case <-time.After(time.Second):
	}
	must(t, "unstage block", h.unstage(blk))
	must(t, "unstage reader-only", h.unstage(ro))
}
