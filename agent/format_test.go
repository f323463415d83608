package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
)

// restart returns an agent on the same state directory, host and
// transports as a, as after a crash of a's process: nothing of a's
// memory is kept.
func restart(t *testing.T, a *Agent) *Agent {
	t.Helper()
	st, err := openStore(a.state.dir)
	if err != nil {
		t.Fatal(err)
	}
	return &Agent{cfg: a.cfg, log: a.log, host: a.host, state: st, marks: a.marks, locks: newInflight(),
		transports: a.transports, verify: a.verify, lookup: a.lookup}
}

// A node that dies while mkfs runs on a device berth found blank leaves
// mkfs' partial writes; the retried stage on the same device finishes
// the format instead of refusing them as foreign data.
func TestStageFinishesFormatInterruptedByCrash(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	hang := make(chan struct{})
	host.mkfsHang = hang
	staging := filepath.Join(t.TempDir(), "staging")
	must(t, "mkdir", mkdirAll(staging))
	req := stageReq("vol-crash", staging, "7")
	first := make(chan error, 1)
	go func() {
		_, err := (&nodeServer{a: a}).NodeStageVolume(context.Background(), req)
		first <- err
	}()
	dev := <-host.mkfsStarted
	// The process is gone: its call never returns, its defers never run.
	t.Cleanup(func() { close(hang); <-first })
	host.mu.Lock()
	host.mkfsHang = nil
	host.mu.Unlock()

	b := restart(t, a)
	if _, err := (&nodeServer{a: b}).NodeStageVolume(context.Background(), req); err != nil {
		t.Fatalf("stage retried after a crash during mkfs: %v", err)
	}
	if c := host.contentOf(dev); c != "ext4" {
		t.Fatalf("device holds %q after the retried stage, want ext4", c)
	}
	rec, ok := b.state.get("vol-crash")
	if !ok || !rec.Staged {
		t.Fatalf("record after the retried stage: %+v", rec)
	}
	if _, ok := recordKeys(t, b, "vol-crash")["formatting"]; ok {
		t.Fatal("the format mark is still recorded once the filesystem is made")
	}
}

// A mkfs that fails after it started writing (killed alone, or its
// device's I/O failing) leaves the volume attached and the format mark
// recorded: the retried stage finishes the format; an unstage instead
// detaches the device and forgets the volume.
func TestStageKeepsFormatMarkWhenMkfsFails(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "staging")
	must(t, "mkdir", mkdirAll(staging))
	req := stageReq("vol-mkfs-fails", staging, "9")
	host.mkfsErr = errors.New("mkfs.ext4: signal: killed")
	if _, err := n.NodeStageVolume(context.Background(), req); err == nil {
		t.Fatal("stage succeeded with mkfs failing")
	}
	rec, ok := a.state.get("vol-mkfs-fails")
	if !ok || rec.Formatting == nil || rec.Staged {
		t.Fatalf("record after mkfs failed: %+v, %v; want the format mark kept", rec, ok)
	}
	host.mu.Lock()
	host.mkfsErr = nil
	host.mu.Unlock()
	if _, err := n.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatalf("stage retried after mkfs failed: %v", err)
	}
	if c := host.contentOf((&fakeTarget{key: "9"}).dev().Path); c != "ext4" {
		t.Fatalf("device holds %q after the retried stage, want ext4", c)
	}

	// Unstaged instead of retried, the volume is forgotten, mark and all.
	host.mu.Lock()
	host.mkfsErr = errors.New("mkfs.ext4: signal: killed")
	host.mu.Unlock()
	staging2 := filepath.Join(t.TempDir(), "staging")
	must(t, "mkdir", mkdirAll(staging2))
	if _, err := n.NodeStageVolume(context.Background(), stageReq("vol-unstaged", staging2, "10")); err == nil {
		t.Fatal("stage succeeded with mkfs failing")
	}
	if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol-unstaged", StagingTargetPath: staging2}); err != nil {
		t.Fatalf("unstage after mkfs failed: %v", err)
	}
	if _, ok := a.state.get("vol-unstaged"); ok {
		t.Fatal("unstage kept the record of a stage whose mkfs failed")
	}
}

// The format mark stays recorded until the stage is, but a stage whose
// mkfs finished and that failed after it (here: the mount) is undone
// like any other failed stage: nothing of the volume is left attached or
// recorded, and the filesystem made stays for the next stage to use.
func TestStageFailingAfterMkfsIsUndone(t *testing.T) {
	a, host, tr := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "staging")
	must(t, "mkdir", mkdirAll(staging))
	req := stageReq("vol-mount-fails", staging, "11")
	host.mountErr = fmt.Errorf("mount: %w", errdefs.ErrInvalidArgument)
	if _, err := n.NodeStageVolume(context.Background(), req); err == nil {
		t.Fatal("stage succeeded with the mount failing")
	}
	if rec, ok := a.state.get("vol-mount-fails"); ok {
		t.Fatalf("a stage that failed after its mkfs left its record: %+v", rec)
	}
	tr.mu.Lock()
	attached, detached := tr.attached["11"], tr.detached["11"]
	tr.mu.Unlock()
	if attached != 1 || detached != 1 {
		t.Fatalf("attached %d, detached %d times; want the failed stage's attach undone", attached, detached)
	}
	dev := (&fakeTarget{key: "11"}).dev().Path
	if c := host.contentOf(dev); c != "ext4" {
		t.Fatalf("device holds %q, want the ext4 made", c)
	}
	host.mu.Lock()
	host.mountErr = nil
	host.mu.Unlock()
	if _, err := n.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatalf("stage again: %v", err)
	}
	if _, ok := recordKeys(t, a, "vol-mount-fails")["formatting"]; ok {
		t.Fatal("the format mark is recorded after the stage finished")
	}
}

// A device holding data that berth did not start formatting stays
// refused, whatever else the record says.
func TestStageRefusesDataItDidNotFormat(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	staging := filepath.Join(t.TempDir(), "staging")
	must(t, "mkdir", mkdirAll(staging))
	dev := (&fakeTarget{key: "8"}).dev().Path
	for _, c := range []string{fakePartial, "unknown-data", "xfs"} {
		host.mu.Lock()
		host.content[dev] = c
		host.mu.Unlock()
		_, err := (&nodeServer{a: restart(t, a)}).NodeStageVolume(context.Background(), stageReq("vol-foreign", staging, "8"))
		if status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("stage of a device holding %s: %v, want FailedPrecondition", c, err)
		}
		if got := host.contentOf(dev); got != c {
			t.Fatalf("device held %s, holds %s after a refused stage", c, got)
		}
	}
	// A mark for another device (here: the same numbers, another disk
	// sequence, as after the device was detached and attached again)
	// does not let the format go on.
	host.mu.Lock()
	host.content[dev] = fakePartial
	host.mu.Unlock()
	other := deviceRecordOf((&fakeTarget{key: "8"}).dev())
	other.DiskSeq = 41
	must(t, "record a mark", a.state.put(&volumeRecord{VolumeID: "vol-foreign", Transport: "fake", Context: map[string]string{"fake": "8"},
		TargetKey: "8", AccessType: "mount", FsType: "ext4", Mode: snw.String(), StagingPath: staging, Formatting: other}))
	_, err := (&nodeServer{a: restart(t, a)}).NodeStageVolume(context.Background(), stageReq("vol-foreign", staging, "8"))
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "not the device found now") {
		t.Fatalf("stage with a format mark of another device: %v, want FailedPrecondition naming the mark", err)
	}
	if got := host.contentOf(dev); got != fakePartial {
		t.Fatalf("device holds %s after a refused stage", got)
	}
}

// recordKeys returns the top-level keys of a volume's state file.
func recordKeys(t *testing.T, a *Agent, id string) map[string]json.RawMessage {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(a.state.dir, stateFileName(id)))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}
