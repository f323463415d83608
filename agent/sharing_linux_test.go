package agent

import (
	"crypto/sha256"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/berth-csi/berth/devices"
)

// loopsOf returns the loop devices whose backing file is below dir.
func loopsOf(t *testing.T, dir string) []*devices.Device {
	t.Helper()
	entries, err := os.ReadDir("/sys/class/block")
	must(t, "list block devices", err)
	var out []*devices.Device
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if d, err := (devices.Roots{}).Lookup(e.Name()); err == nil && strings.HasPrefix(d.ID.BackingFile, dir+"/") {
			out = append(out, d)
		}
	}
	return out
}

// A hard link to a staged image is the same storage: staging it as a
// second volume is refused before anything is attached, and the refusal
// (and the unstage of the refused volume) leaves the first volume's loop
// device and mount alone.
func TestStageHardLinkOfStagedImage(t *testing.T) {
	for _, block := range []bool{false, true} {
		name := "mount"
		c := mountCap("ext4", snw)
		if block {
			name, c = "block", blockCap(snw)
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			a := h.newVol("a", 64*mib, c)
			must(t, "stage a", h.stage(a))
			loops := loopsOf(t, h.root)
			if len(loops) != 1 {
				t.Fatalf("after staging a: %d loop devices", len(loops))
			}
			must(t, "hard link", os.Link(filepath.Join(h.root, "a.img"), filepath.Join(h.root, "b.img")))
			b := vol{id: "vol-b", staging: h.mkdir("staging/b"), vctx: map[string]string{"file": "b.img"}, cap: c}
			err := h.stage(b)
			wantCode(t, "stage a hard link of a staged image", err, codes.FailedPrecondition)
			if !strings.Contains(err.Error(), `"vol-a"`) {
				t.Fatalf("refusal does not name the staged volume: %v", err)
			}
			t.Log(err)
			if got := loopsOf(t, h.root); len(got) != 1 || got[0].Name != loops[0].Name {
				t.Fatalf("refused stage changed the loop devices: %v, had %v", got, loops)
			}
			if _, ok := h.recordOf(b.id); ok {
				t.Fatal("refused stage left a record")
			}
			if !block && mountsAt(t, a.staging) != 1 {
				t.Fatal("a is no longer mounted")
			}
			must(t, "unstage the refused volume", h.unstage(b))
			if got := loopsOf(t, h.root); len(got) != 1 || got[0].Name != loops[0].Name {
				t.Fatalf("unstage of the refused volume changed the loop devices: %v, had %v", got, loops)
			}
			must(t, "a again", h.stage(a))
			must(t, "unstage a", h.unstage(a))
			if got := loopsOf(t, h.root); len(got) != 0 {
				t.Fatalf("after unstaging a: %v", got)
			}
			// Once a is gone, the other name of the image may be staged.
			must(t, "stage b", h.stage(b))
			must(t, "unstage b", h.unstage(b))
		})
	}
}

// An interrupted stage of a second name of the image (a record written,
// nothing attached) must not detach the first volume's loop device when
// it is retried or unstaged.
func TestInterruptedStageOfSharedImage(t *testing.T) {
	h := newHarness(t)
	a := h.newVol("a", 64*mib, blockCap(snw))
	must(t, "stage a", h.stage(a))
	loops := loopsOf(t, h.root)
	must(t, "hard link", os.Link(filepath.Join(h.root, "a.img"), filepath.Join(h.root, "b.img")))
	b := vol{id: "vol-b", staging: h.mkdir("staging/b"), vctx: map[string]string{"file": "b.img"}, cap: blockCap(snw)}
	h.stop()
	st, err := openStore(filepath.Join(h.stateDir, "volumes"))
	must(t, "open state", err)
	must(t, "write intent", st.put(&volumeRecord{
		VolumeID: b.id, Transport: "file", Context: b.vctx, TargetKey: filepath.Join(h.root, "b.img"),
		AccessType: "block", Mode: snw.String(), StagingPath: b.staging,
	}))
	h.start()
	wantCode(t, "retry of the interrupted stage", h.stage(b), codes.FailedPrecondition)
	must(t, "unstage of the interrupted stage", h.unstage(b))
	if got := loopsOf(t, h.root); len(got) != 1 || got[0].Name != loops[0].Name {
		t.Fatalf("the interrupted stage's undo changed a's loop devices: %v, had %v", got, loops)
	}
	must(t, "unstage a", h.unstage(a))
}

// A volume staged by an earlier version, whose record names the image by
// its path, still answers OK to a repeated stage and unstages.
func TestOldRecordStillWorks(t *testing.T) {
	for _, block := range []bool{false, true} {
		name := "mount"
		c := mountCap("ext4", snw)
		if block {
			name, c = "block", blockCap(snw)
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("old", 64*mib, c)
			img := filepath.Join(h.root, "old.img")
			must(t, "stage", h.stage(v))
			h.stop()
			// The earlier version's loop device: attached without
			// berth's mark (as losetup does), found by its inode.
			if !block {
				must(t, "unmount", syscall.Unmount(v.staging, 0))
			}
			d, err := devices.Roots{}.FindLoop(img)
			must(t, "find loop", err)
			must(t, "detach", devices.DetachLoop(d))
			if out, err := exec.Command("losetup", "--find", img).CombinedOutput(); err != nil {
				t.Fatalf("losetup: %v: %s", err, out)
			}
			// Rewrite the record as the earlier version wrote it: the
			// target key is the image's path, nothing else about the
			// image is recorded.
			file := filepath.Join(h.stateDir, "volumes", stateFileName(v.id))
			b, err := os.ReadFile(file)
			must(t, "read record", err)
			var m map[string]any
			must(t, "parse record", json.Unmarshal(b, &m))
			m["targetKey"] = img
			for k := range m {
				if k == "targetID" {
					delete(m, k)
				}
			}
			b, err = json.MarshalIndent(m, "", "  ")
			must(t, "encode record", err)
			must(t, "write record", os.WriteFile(file, b, 0o600))
			h.start()
			must(t, "repeated stage of an old record", h.stage(v))
			// Another volume on the same image is still refused.
			other := vol{id: "vol-other", staging: h.mkdir("staging/other"), vctx: v.vctx, cap: c}
			wantCode(t, "second volume on an old record's image", h.stage(other), codes.FailedPrecondition)
			must(t, "unstage of an old record", h.unstage(v))
			if got := loopsOf(t, h.root); len(got) != 0 {
				t.Fatalf("after unstage: %v", got)
			}
		})
	}
}

// losetup attaches img the way an operator would, with extra arguments
// (an offset, a size limit), and detaches it when the test ends.
func losetup(t *testing.T, img string, args ...string) string {
	t.Helper()
	out, err := exec.Command("losetup", append(append([]string{"--find", "--show"}, args...), img)...).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup %v %s: %v: %s", args, img, err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup -d %s: %v: %s", dev, err, out)
		}
	})
	return dev
}

func sum(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	must(t, "read "+p, err)
	return sha256.Sum256(b)
}

// A loop device an operator set up on the image at an offset or with a
// size limit is not the volume's device: the stage is refused, naming the
// device and what differs, and neither the image nor the device change.
func TestStageRefusesForeignLoopDevice(t *testing.T) {
	for _, tc := range []struct {
		name, want string
		args       []string
	}{
		{"offset", "offset", []string{"--offset", "1048576"}},
		{"sizelimit", "size limit", []string{"--sizelimit", "33554432"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("op", 64*mib, mountCap("ext4", snw))
			img := filepath.Join(h.root, "op.img")
			foreign := losetup(t, img, tc.args...)
			if out, err := exec.Command("mkfs.ext4", "-q", foreign).CombinedOutput(); err != nil {
				t.Fatalf("mkfs.ext4 %s: %v: %s", foreign, err, out)
			}
			before := sum(t, img)
			err := h.stage(v)
			wantCode(t, "stage over an operator's loop device", err, codes.FailedPrecondition)
			if !strings.Contains(err.Error(), foreign) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("refusal does not name %s and its %s: %v", foreign, tc.want, err)
			}
			t.Log(err)
			if sum(t, img) != before {
				t.Fatal("the refused stage changed the image")
			}
			if got := loopsOf(t, h.root); len(got) != 1 || got[0].Path != foreign {
				t.Fatalf("loop devices after the refused stage: %v, want only %s", got, foreign)
			}
			if out, err := exec.Command("e2fsck", "-fn", foreign).CombinedOutput(); err != nil {
				t.Fatalf("e2fsck of the operator's filesystem: %v: %s", err, out)
			}
			if n := len(stateFiles(t, h)); n != 0 {
				t.Fatalf("refused stage left %d state files", n)
			}
		})
	}
}

// Unstage detaches berth's loop device of the image and leaves an
// operator's device on the same image (at an offset) attached, also when
// the image was deleted meanwhile.
func TestUnstageLeavesForeignLoopDevice(t *testing.T) {
	h := newHarness(t)
	var foreign []string
	for _, name := range []string{"op", "gone"} {
		v := h.newVol(name, 64*mib, blockCap(snw))
		img := filepath.Join(h.root, name+".img")
		must(t, "stage", h.stage(v))
		foreign = append(foreign, losetup(t, img, "--offset", "1048576"))
		if name == "gone" {
			must(t, "delete image", os.Remove(img))
		}
		must(t, "unstage", h.unstage(v))
	}
	var got []string
	for _, d := range loopsOf(t, h.root) {
		got = append(got, d.Path)
	}
	slices.Sort(got)
	slices.Sort(foreign)
	if strings.Join(got, " ") != strings.Join(foreign, " ") {
		t.Fatalf("loop devices after unstage: %v, want only the operator's %v", got, foreign)
	}
}

// A record whose identity is stale (written before a reboot changed the
// image's device number) is looked at again: a hard link of its image
// staged as another volume is refused, also on later attempts, and an
// unrelated image still stages.
func TestStageRefusesLinkOfRecordWithStaleIdentity(t *testing.T) {
	h := newHarness(t)
	c := mountCap("ext4", snw)
	v := h.newVol("a", 64*mib, c)
	must(t, "stage", h.stage(v))
	h.stop()
	file := filepath.Join(h.stateDir, "volumes", stateFileName(v.id))
	b, err := os.ReadFile(file)
	must(t, "read record", err)
	var m map[string]any
	must(t, "parse record", json.Unmarshal(b, &m))
	if m["targetID"] == nil {
		t.Fatalf("the record has no identity: %s", b)
	}
	m["targetID"] = "file 1:1"
	b, err = json.MarshalIndent(m, "", "  ")
	must(t, "encode record", err)
	must(t, "write record", os.WriteFile(file, b, 0o600))
	h.start()
	must(t, "hard link", os.Link(filepath.Join(h.root, "a.img"), filepath.Join(h.root, "b.img")))
	other := vol{id: "vol-b", staging: h.mkdir("staging/b"), vctx: map[string]string{"file": "b.img"}, cap: c}
	for range 2 {
		// Refused by the identity check, before anything is attached.
		err := h.stage(other)
		wantCode(t, "a second name of a record's image", err, codes.FailedPrecondition)
		if !strings.Contains(err.Error(), `the same storage is already staged on this node as volume "vol-a"`) {
			t.Fatalf("refused, but not as the same storage as vol-a: %v", err)
		}
	}
	unrelated := h.newVol("c", 64*mib, c)
	must(t, "stage an unrelated image", h.stage(unrelated))
	must(t, "unstage the unrelated volume", h.unstage(unrelated))
	must(t, "unstage", h.unstage(v))
}
