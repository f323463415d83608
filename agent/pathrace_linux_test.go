package agent

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// mountsUnder lists the mount points in /proc/self/mountinfo at or below
// dir.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			out = append(out, f[4])
		}
	}
	return out
}

// devOf returns the device of the filesystem at p (not following a
// symlink at p).
func devOf(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatalf("lstat %s: %v", p, err)
	}
	return st.Dev
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// victimVol stages and publishes a volume inside dir (staging dir/s,
// target dir/mount): the mounts a redirected RPC would hit.
func (h *harness) victimVol(t *testing.T, dir string) vol {
	b := h.newVol("victim", 64*mib, mountCap("ext4", snw))
	b.staging = filepath.Join(dir, "s")
	b.target = filepath.Join(dir, "mount")
	must(t, "mkdir victim staging", os.Mkdir(b.staging, 0o750))
	must(t, "stage victim", h.stage(b))
	must(t, "publish victim", h.publish(b, false))
	return b
}

// checkVictim asserts that dir holds exactly the victim's two mounts,
// both of its device, and no name berth created.
func checkVictim(t *testing.T, dir string, dev uint64) {
	t.Helper()
	want := []string{filepath.Join(dir, "mount"), filepath.Join(dir, "s")}
	got := mountsUnder(t, dir)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("mounts under %s: %q; want only the other volume's %q", dir, got, want)
	}
	for _, p := range want {
		if d := devOf(t, p); d != dev {
			t.Errorf("%s shows device %d:%d, not the other volume's %d:%d", p, unix.Major(d), unix.Minor(d), unix.Major(dev), unix.Minor(dev))
		}
	}
	if n := names(t, dir); !slices.Equal(n, []string{"mount", "s"}) {
		t.Errorf("%s holds %q; want only mount and s", dir, n)
	}
}

// swapper exchanges each pair (a directory and a symlink) with
// renameat2(RENAME_EXCHANGE) in a tight loop until stopped, then leaves
// the directories at their names.
func swapper(t *testing.T, pairs [][2]string) (stop func() int) {
	quit, done := make(chan struct{}), make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-quit:
				for _, p := range pairs {
					var st unix.Stat_t
					if err := unix.Lstat(p[0], &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
						if err := unix.Renameat2(unix.AT_FDCWD, p[0], unix.AT_FDCWD, p[1], unix.RENAME_EXCHANGE); err != nil {
							t.Errorf("restore %s: %v", p[0], err)
						}
					}
				}
				done <- n
				return
			default:
			}
			for _, p := range pairs {
				if err := unix.Renameat2(unix.AT_FDCWD, p[0], unix.AT_FDCWD, p[1], unix.RENAME_EXCHANGE); err != nil {
					t.Errorf("exchange %s: %v", p[0], err)
					done <- n
					return
				}
			}
			n++
		}
	}()
	return func() int { close(quit); return <-done }
}

// codeCount counts the answers of one RPC.
type codeCount struct {
	mu sync.Mutex
	m  map[string]map[codes.Code]int
}

func (c *codeCount) add(rpc string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[string]map[codes.Code]int)
	}
	if c.m[rpc] == nil {
		c.m[rpc] = make(map[codes.Code]int)
	}
	c.m[rpc][status.Code(err)]++
}

// The parent of a target or staging path is swapped between a directory
// and a symlink to a directory holding another volume's staging mount
// and publish target while publish, unpublish, stage and unstage run.
// Whatever each RPC answers, nothing may be mounted, created or
// unmounted through the symlink.
func TestPathSwapRace(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	victimDir := h.mkdir("victim")
	b := h.victimVol(t, victimDir)
	victimDev := devOf(t, b.staging)

	a := h.newVol("a", 64*mib, mountCap("ext4", snw))
	a.target = filepath.Join(h.mkdir("pods/race"), "mount")
	must(t, "stage a", h.stage(a))
	c := h.newVol("c", 64*mib, mountCap("ext4", snw))
	c.staging = filepath.Join(h.mkdir("stg/c"), "s")
	must(t, "mkdir c staging", os.Mkdir(c.staging, 0o750))

	pairs := [][2]string{
		{filepath.Join(h.dir, "pods/race"), filepath.Join(h.dir, "pods/race-link")},
		{filepath.Join(h.dir, "stg/c"), filepath.Join(h.dir, "stg/c-link")},
	}
	for _, p := range pairs {
		must(t, "symlink", os.Symlink(victimDir, p[1]))
	}

	var counts codeCount
	deadline := time.Now().Add(2 * time.Second)
	stop := swapper(t, pairs)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for time.Now().Before(deadline) {
			_, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: a.id, StagingTargetPath: a.staging, TargetPath: a.target, VolumeCapability: a.cap})
			counts.add("publish", err)
			_, err = h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: a.id, TargetPath: a.target})
			counts.add("unpublish", err)
		}
	}()
	go func() {
		defer wg.Done()
		for time.Now().Before(deadline) {
			_, err := h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: c.id, StagingTargetPath: c.staging, VolumeCapability: c.cap, VolumeContext: c.vctx})
			counts.add("stage", err)
			_, err = h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: c.id, StagingTargetPath: c.staging})
			counts.add("unstage", err)
		}
	}()
	wg.Wait()
	swaps := stop()
	t.Logf("%d exchanges; answers %v", swaps, counts.m)
	for _, rpc := range []string{"publish", "unpublish", "stage", "unstage"} {
		n := 0
		for _, k := range counts.m[rpc] {
			n += k
		}
		if n < 10 {
			t.Errorf("%s ran %d times; the race needs more", rpc, n)
		}
	}

	checkVictim(t, victimDir, victimDev)
	if t.Failed() {
		t.FailNow()
	}
	must(t, "unpublish a", h.unpublish(a))
	must(t, "unstage c", h.unstage(c))
	must(t, "unstage a", h.unstage(a))
	must(t, "unpublish victim", h.unpublish(b))
	must(t, "unstage victim", h.unstage(b))
}

// NodeUnstageVolume unmounts only the volume's own staging mount: not
// another volume's mount reached through a symlink put in the staging
// path's parent, nor another volume's mount found at the staging path.
func TestUnstageChecksStagingPath(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	victimDir := h.mkdir("victim")
	b := h.victimVol(t, victimDir)
	victimDev := devOf(t, b.staging)

	a := h.newVol("a", 64*mib, mountCap("ext4", snw))
	a.staging = filepath.Join(h.mkdir("stg/a"), "s")
	must(t, "mkdir a staging", os.Mkdir(a.staging, 0o750))
	must(t, "stage a", h.stage(a))

	// The parent of a's staging path becomes a symlink to the directory
	// that holds the victim's staging mount.
	parent := filepath.Dir(a.staging)
	must(t, "move parent away", os.Rename(parent, parent+"-real"))
	must(t, "symlink parent", os.Symlink(victimDir, parent))
	_, err := h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: a.id, StagingTargetPath: a.staging})
	if err == nil {
		t.Errorf("unstage through a symlinked parent answered OK")
	}
	checkVictim(t, victimDir, victimDev)
	if t.Failed() {
		t.FailNow()
	}
	must(t, "remove symlink", os.Remove(parent))
	must(t, "move parent back", os.Rename(parent+"-real", parent))

	// A staging path that shows another volume's filesystem: a's own
	// mount is gone and the victim's staging root is bound there.
	must(t, "umount a behind berth's back", unix.Unmount(a.staging, 0))
	must(t, "bind victim at a's staging", unix.Mount(b.staging, a.staging, "", unix.MS_BIND, ""))
	_, err = h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: a.id, StagingTargetPath: a.staging})
	wantCode(t, "unstage of a staging path showing another volume", err, codes.FailedPrecondition)
	if got := mountsUnder(t, a.staging); len(got) != 1 || devOf(t, a.staging) != victimDev {
		t.Errorf("after the refused unstage %s holds mounts %q; want the victim's bind untouched", a.staging, got)
	}
	must(t, "umount the bind", unix.Unmount(a.staging, 0))
	must(t, "unstage a", h.unstage(a))
	checkVictim(t, victimDir, victimDev)
	must(t, "unpublish victim", h.unpublish(b))
	must(t, "unstage victim", h.unstage(b))
}

// A target that is a non-empty directory, or lies inside a staging path
// (the volume's own or another's), or holds one, is refused: binding
// there hides files or binds a volume into itself, and such a publish
// could never be unpublished.
func TestPublishTargetRules(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	v := h.newVol("v", 64*mib, mountCap("ext4", snw))
	w := h.newVol("w", 64*mib, mountCap("ext4", snw))
	must(t, "stage v", h.stage(v))
	must(t, "stage w", h.stage(w))
	publish := func(target string) error {
		_, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: target, VolumeCapability: v.cap})
		if err == nil {
			// Leave nothing mounted for the next case.
			if _, uerr := h.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: target}); uerr != nil {
				t.Logf("unpublish %s after the accepted publish: %v", target, uerr)
				unix.Unmount(target, unix.MNT_DETACH)
			}
		}
		return err
	}

	full := h.mkdir("pods/full/mount")
	must(t, "write file", os.WriteFile(filepath.Join(full, "keep"), []byte("the node's"), 0o644))
	wantCode(t, "publish onto a non-empty directory", publish(full), codes.FailedPrecondition)
	if got := mountsUnder(t, full); len(got) != 0 {
		t.Errorf("refused publish left %q mounted", got)
	}
	if b, err := os.ReadFile(filepath.Join(full, "keep")); err != nil || string(b) != "the node's" {
		t.Errorf("file in the refused target: %q, %v", b, err)
	}

	must(t, "mkdir in volume", os.Mkdir(filepath.Join(v.staging, "inner"), 0o755))
	wantCode(t, "publish inside its own staging path", publish(filepath.Join(v.staging, "inner")), codes.InvalidArgument)
	wantCode(t, "publish inside another volume's staging path", publish(filepath.Join(w.staging, "inner")), codes.InvalidArgument)
	wantCode(t, "publish onto a directory holding staging paths", publish(filepath.Dir(v.staging)), codes.InvalidArgument)
	if got := mountsUnder(t, filepath.Dir(v.staging)); len(got) != 2 {
		t.Errorf("mounts under the staging directory: %q; want the two staging mounts", got)
	}
	// The same directory reached through a bind of the volume under
	// another name.
	alias := h.mkdir("alias")
	must(t, "bind volume elsewhere", unix.Mount(v.staging, alias, "", unix.MS_BIND, ""))
	wantCode(t, "publish inside the volume through a bind", publish(filepath.Join(alias, "inner")), codes.InvalidArgument)
	must(t, "umount alias", unix.Unmount(alias, 0))
	must(t, "rmdir in volume", os.Remove(filepath.Join(v.staging, "inner")))

	// An empty existing directory is a normal target.
	empty := h.mkdir("pods/empty/mount")
	must(t, "publish onto an empty directory", publish(empty))

	must(t, "unstage w", h.unstage(w))
	must(t, "unstage v", h.unstage(v))
}

// The image of a block volume is exchanged with a symbolic link to a file
// outside the file root, which has a loop device of its own held open,
// while the volume is staged and unstaged: the image is renamed and its
// name leads elsewhere at every step. Each RPC answers within its
// deadline with a code that says what happened (never Internal, never
// the deadline), the other file's loop device is never detached nor set
// to autoclear, and no loop device of the image is left behind.
func TestStageImageRenameRace(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("a", 64*mib, blockCap(snw))
	outside := filepath.Join(h.mkdir("outside"), "other.img")
	must(t, "create the other file", os.WriteFile(outside, make([]byte, 1<<20), 0o600))
	theirs := losetup(t, outside)
	held, err := os.Open(theirs)
	must(t, "hold "+theirs, err)
	defer held.Close()
	img, link := filepath.Join(h.root, "a.img"), filepath.Join(h.root, "a-link.img")
	must(t, "symlink", os.Symlink(outside, link))

	allowed := map[codes.Code]bool{codes.OK: true, codes.NotFound: true, codes.InvalidArgument: true, codes.FailedPrecondition: true}
	var counts codeCount
	call := func(rpc string, f func(context.Context) error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		start := time.Now()
		err := f(ctx)
		counts.add(rpc, err)
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("%s answered after %v: %v", rpc, el.Round(time.Millisecond), err)
		}
		if !allowed[status.Code(err)] || (rpc == "unstage" && err != nil) {
			t.Errorf("%s: %v", rpc, err)
		}
	}
	stop := swapper(t, [][2]string{{img, link}})
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); {
		call("stage", func(ctx context.Context) error {
			_, err := h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx})
			return err
		})
		call("unstage", func(ctx context.Context) error {
			_, err := h.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
			return err
		})
	}
	swaps := stop()
	t.Logf("%d exchanges; answers %v", swaps, counts.m)
	if counts.m["stage"][codes.OK] == 0 {
		t.Error("no stage succeeded; the race needs more")
	}
	if got := loopBacking(t, theirs); got != outside {
		t.Errorf("%s, the loop device of %s, was detached (backing now %q)", theirs, outside, got)
	} else if loopAutoclear(t, theirs) {
		t.Errorf("autoclear set on %s, the loop device of %s", theirs, outside)
	}
	if got := loopsOf(t, h.root); len(got) != 0 {
		t.Errorf("loop devices of the image left: %v", got)
	}
	if _, ok := h.recordOf(v.id); ok {
		t.Error("record left")
	}
}
