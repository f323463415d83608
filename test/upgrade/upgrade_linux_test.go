// Package upgrade runs berth's released v0.1.0 and today's berth on the
// same state directory: volumes v0.1.0 staged and published are driven
// by today's berth to the end of their life, and today's state is shown
// to v0.1.0 (a rollback). File volumes run on the host; NVMe/TCP and
// iSCSI volumes in a QEMU guest of test/vm, against nvmet and LIO there
// (TestVMUpgrade).
package upgrade

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// v010 is the commit that set VERSION to v0.1.0, the first release.
const v010 = "ff7984b9cd39d863ecbf68d694d842bf25c55cd5"

const mib = 1 << 20

// need fails under BERTH_CI=1 and skips otherwise when a prerequisite is
// missing.
func need(t *testing.T, ok bool, what string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("BERTH_CI") == "1" {
		t.Fatalf("BERTH_CI=1: the upgrade test needs %s", what)
	}
	t.Skipf("needs %s", what)
}

func prerequisites(t *testing.T) {
	need(t, os.Geteuid() == 0, "root (loop devices, mounts)")
	for _, tool := range []string{"git", "go", "mkfs.ext4", "mkfs.xfs", "losetup", "findmnt"} {
		_, err := exec.LookPath(tool)
		need(t, err == nil, tool)
	}
}

// The binaries are built once per test run, into buildDir.
var (
	buildDir          string
	v010Once, curOnce sync.Once
	v010Bin, curBin   string
	v010Fail, curFail string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// binDir is buildDir, made at its first use.
func binDir(t *testing.T) string {
	if buildDir == "" {
		d, err := os.MkdirTemp("", "berth-upgrade-test-")
		must(t, err)
		buildDir = d
	}
	return buildDir
}

// buildOnce runs build once for the whole test run: a failure fails
// each test that needs what it builds.
func buildOnce(t *testing.T, name string, once *sync.Once, bin, fail *string, build func(*testing.T) string) string {
	t.Helper()
	once.Do(func() {
		ok := t.Run(name, func(t *testing.T) { *bin = build(t) })
		if !ok {
			*fail = name + " failed (see the first test that ran it)"
		}
	})
	if *fail != "" {
		t.Fatal(*fail)
	}
	return *bin
}

// buildV010 builds the v0.1.0 release from the repository's history (a
// shallow clone lacks it), with the local module cache and the proxy for
// what it lacks.
func buildV010(t *testing.T) string {
	return buildOnce(t, "build_v0.1.0", &v010Once, &v010Bin, &v010Fail, func(t *testing.T) string {
		dir, err := os.MkdirTemp(binDir(t), "v0.1.0-")
		must(t, err)
		start := time.Now()
		bin := buildV010In(t, dir)
		t.Logf("built v0.1.0 (%s) in %v", v010[:12], time.Since(start).Round(time.Millisecond))
		return bin
	})
}

func buildV010In(t *testing.T, dir string) string {
	src, tar := filepath.Join(dir, "src"), filepath.Join(dir, "src.tar")
	out, err := exec.Command("git", "-C", "../..", "cat-file", "-e", v010+"^{commit}").CombinedOutput()
	need(t, err == nil, fmt.Sprintf("the v0.1.0 commit %s in the repository's history (a full clone): %s", v010, out))
	run(t, "", nil, "git", "-C", "../..", "archive", "-o", tar, v010)
	must(t, os.Mkdir(src, 0o750))
	run(t, "", nil, "tar", "-xf", tar, "-C", src)
	bin := filepath.Join(dir, "berth-v0.1.0")
	run(t, src, []string{"CGO_ENABLED=0", "GOFLAGS=-mod=mod", "GOTOOLCHAIN=local"},
		"go", "build", "-trimpath", "-ldflags", "-X main.version=v0.1.0 -X main.commit="+v010, "-o", bin, ".")
	return bin
}

// currentBinary is $BERTH_BIN, or berth built from this tree.
func currentBinary(t *testing.T) string {
	if p := os.Getenv("BERTH_BIN"); p != "" {
		return p
	}
	return buildOnce(t, "build_berth", &curOnce, &curBin, &curFail, func(t *testing.T) string {
		bin := filepath.Join(binDir(t), "berth")
		run(t, "../..", []string{"CGO_ENABLED=0"}, "go", "build", "-o", bin, ".")
		return bin
	})
}

func run(t *testing.T, dir string, env []string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// node is one world of volumes: a state directory, staging and target
// paths below a temporary directory, and the storage of one or more
// transports.
type node struct {
	t     *testing.T
	dir   string
	state string
	sock  string
	// args are serve's flags of the node's transports (both berths
	// take them).
	args []string
	// kernel lists what berth made in the kernel for the node's
	// volumes (loop devices, NVMe controllers, iSCSI sessions and node
	// records, reservations at the target), sorted; wantKernel is how
	// many entries it has while every volume is staged.
	kernel     func() []string
	wantKernel int
	// release tears down what kernel lists, when a test failed.
	release func()
	cmd     *exec.Cmd
	ended   chan struct{} // closed when cmd has exited
	logs    *bytes.Buffer
	conn    *grpc.ClientConn
	csi     csi.NodeClient
	vols    []*volume
}

type volume struct {
	id     string
	fsType string // "" for raw block
	size   int64
	// vctx is the volume_context, in keys v0.1.0 knows.
	vctx map[string]string
	// grow enlarges the storage to size bytes.
	grow    func(size int64)
	staging string
	target  string
	payload []byte
}

// newNode makes the node's directories and the paths of vols; kernel,
// wantKernel and release are the caller's to set.
func newNode(t *testing.T, args []string, vols ...*volume) *node {
	dir := t.TempDir()
	n := &node{t: t, dir: dir, state: filepath.Join(dir, "state"), sock: filepath.Join(dir, "csi.sock"), args: args, vols: vols,
		kernel: func() []string { return nil }, release: func() {}}
	for _, v := range vols {
		v.staging = filepath.Join(dir, "staging", v.id)
		// The target's parent is the CO's; the target is the plugin's
		// to make.
		v.target = filepath.Join(dir, "pods", v.id, "vol")
		must(t, os.MkdirAll(v.staging, 0o750))
		must(t, os.MkdirAll(filepath.Dir(v.target), 0o750))
	}
	t.Cleanup(n.cleanup)
	return n
}

// newFileNode is a node of file volumes (ext4, xfs, raw block) over
// image files below its --file-root.
func newFileNode(t *testing.T) *node {
	root := filepath.Join(t.TempDir(), "images")
	must(t, os.MkdirAll(root, 0o750))
	var vols []*volume
	for _, v := range []*volume{
		{id: "vol-ext4", fsType: "ext4", size: 64 * mib},
		{id: "vol-xfs", fsType: "xfs", size: 300 * mib},
		{id: "vol-block", size: 64 * mib},
	} {
		img := filepath.Join(root, v.id+".img")
		must(t, os.WriteFile(img, nil, 0o600))
		must(t, os.Truncate(img, v.size))
		v.vctx = map[string]string{"file": filepath.Base(img)}
		v.grow = func(size int64) { must(t, os.Truncate(img, size)) }
		vols = append(vols, v)
	}
	n := newNode(t, []string{"--file-root", root, "--transports", ""}, vols...)
	n.kernel = func() []string { return loopDevices(root) }
	n.wantKernel = len(vols)
	n.release = func() {
		for _, l := range loopDevices(root) {
			dev, _, _ := strings.Cut(l, " ")
			_ = exec.Command("losetup", "-d", "/dev/"+dev).Run()
		}
	}
	return n
}

// loopDevices lists the loop devices of image files below root: "loopN
// backing-file".
func loopDevices(root string) []string {
	var out []string
	ents, _ := os.ReadDir("/sys/block")
	for _, e := range ents {
		bf, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "loop", "backing_file"))
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(bf)), root+"/") {
			out = append(out, "loop device "+e.Name()+" "+strings.TrimSpace(string(bf)))
		}
	}
	slices.Sort(out)
	return out
}

// start runs bin serve on the node's state and waits for it to be ready;
// false when it exits first.
func (n *node) start(bin string) bool {
	n.t.Helper()
	n.logs = &bytes.Buffer{}
	cmd := exec.Command(bin, append([]string{"serve", "--endpoint", "unix://" + n.sock, "--node-id", "upgrade-node", "--state-dir", n.state,
		"--log-format", "text", "--log-level", "debug"}, n.args...)...)
	cmd.Stdout, cmd.Stderr = n.logs, n.logs
	must(n.t, cmd.Start())
	n.cmd = cmd
	exited := make(chan struct{})
	n.ended = exited
	go func() { _ = cmd.Wait(); close(exited) }()
	conn, err := grpc.NewClient("unix://"+n.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(n.t, err)
	n.conn, n.csi = conn, csi.NewNodeClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		select {
		case <-exited:
			return false
		default:
		}
		pctx, pcancel := context.WithTimeout(ctx, time.Second)
		r, err := csi.NewIdentityClient(conn).Probe(pctx, &csi.ProbeRequest{})
		pcancel()
		if err == nil && r.GetReady().GetValue() {
			return true
		}
		if ctx.Err() != nil {
			n.t.Fatalf("%s not ready: %v\n%s", bin, err, n.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop ends berth with SIGTERM, as kubelet or systemd would.
func (n *node) stop() {
	if n.cmd == nil {
		return
	}
	n.conn.Close()
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.ended:
	case <-time.After(60 * time.Second):
		n.t.Errorf("berth did not end within 60 s of SIGTERM; killed")
		_ = n.cmd.Process.Kill()
		<-n.ended
	}
	n.cmd = nil
}

func (n *node) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 60*time.Second)
}

func (v *volume) capability() *csi.VolumeCapability {
	mode := &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}
	if v.fsType == "" {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}, AccessMode: mode}
	}
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: v.fsType}}, AccessMode: mode}
}

func (n *node) stage(v *volume) error {
	ctx, cancel := n.ctx()
	defer cancel()
	_, err := n.csi.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.capability(), VolumeContext: v.vctx})
	return err
}

func (n *node) publish(v *volume) error {
	ctx, cancel := n.ctx()
	defer cancel()
	_, err := n.csi.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.capability(), VolumeContext: v.vctx})
	return err
}

func (n *node) unpublish(v *volume) error {
	ctx, cancel := n.ctx()
	defer cancel()
	_, err := n.csi.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
	return err
}

func (n *node) unstage(v *volume) error {
	ctx, cancel := n.ctx()
	defer cancel()
	_, err := n.csi.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	return err
}

func (n *node) stats(v *volume) (*csi.NodeGetVolumeStatsResponse, error) {
	ctx, cancel := n.ctx()
	defer cancel()
	return n.csi.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
}

// expand doubles the storage and has berth grow the volume.
func (n *node) expand(v *volume) error {
	v.size *= 2
	v.grow(v.size)
	ctx, cancel := n.ctx()
	defer cancel()
	r, err := n.csi.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target, CapacityRange: &csi.CapacityRange{RequiredBytes: v.size}, VolumeCapability: v.capability()})
	if err == nil && r.GetCapacityBytes() < v.size {
		err = fmt.Errorf("capacity %d after expand, want %d", r.GetCapacityBytes(), v.size)
	}
	return err
}

func (n *node) ok(what string, v *volume, err error) {
	n.t.Helper()
	if err != nil {
		n.t.Fatalf("%s %s: %v\nberth log:\n%s", what, v.id, err, n.logs)
	}
}

// lifecycleStart stages and publishes every volume and writes its data.
func (n *node) lifecycleStart() {
	n.t.Helper()
	for _, v := range n.vols {
		n.ok("NodeStageVolume", v, n.stage(v))
		n.ok("NodePublishVolume", v, n.publish(v))
		v.payload = fmt.Appendf(nil, "%s written at %s\n", v.id, time.Now().Format(time.RFC3339Nano))
		n.ok("write", v, n.write(v))
		n.ok("read", v, n.check(v))
	}
}

// lifecycleEnd unpublishes and unstages every volume.
func (n *node) lifecycleEnd() {
	n.t.Helper()
	for _, v := range n.vols {
		n.ok("NodeUnpublishVolume", v, n.unpublish(v))
		n.ok("NodeUnstageVolume", v, n.unstage(v))
	}
}

// write puts the volume's payload on it through the pod's path: a file
// of the filesystem, or 1 MiB into the raw block device.
func (n *node) write(v *volume) error {
	p, flags, off := v.target, os.O_WRONLY, int64(mib)
	if v.fsType != "" {
		p, flags, off = filepath.Join(v.target, "data"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0
	}
	f, err := os.OpenFile(p, flags, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.WriteAt(v.payload, off); err != nil {
		return err
	}
	return f.Sync()
}

func (n *node) check(v *volume) error {
	var got []byte
	var err error
	if v.fsType != "" {
		got, err = os.ReadFile(filepath.Join(v.target, "data"))
	} else {
		var f *os.File
		if f, err = os.Open(v.target); err == nil {
			got = make([]byte, len(v.payload))
			_, err = f.ReadAt(got, mib)
			f.Close()
		}
	}
	if err == nil && !bytes.Equal(got, v.payload) {
		err = fmt.Errorf("data %q, want %q", got, v.payload)
	}
	return err
}

// host is what of the node a berth made: the mounts below the node's
// directory, the kernel's objects of its volumes, the state records.
type host struct {
	mounts  []string
	kernel  []string
	records map[string]string // file name: contents
}

func (n *node) host() host {
	h := host{records: map[string]string{}}
	b, err := os.ReadFile("/proc/self/mountinfo")
	must(n.t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], n.dir+"/") {
			h.mounts = append(h.mounts, f[4])
		}
	}
	slices.Sort(h.mounts)
	h.kernel = n.kernel()
	recs, _ := os.ReadDir(filepath.Join(n.state, "volumes"))
	for _, r := range recs {
		b, err := os.ReadFile(filepath.Join(n.state, "volumes", r.Name()))
		must(n.t, err)
		h.records[r.Name()] = string(b)
	}
	return h
}

// formats returns the format version of every record.
func (h host) formats(t *testing.T) []int {
	var out []int
	for name, b := range h.records {
		var v struct{ Version int }
		if err := json.Unmarshal([]byte(b), &v); err != nil {
			t.Fatalf("record %s: %v", name, err)
		}
		out = append(out, v.Version)
	}
	return out
}

func (n *node) requireNothingLeft() {
	n.t.Helper()
	h := n.host()
	var left []string
	for _, m := range h.mounts {
		left = append(left, "mount "+m)
	}
	left = append(left, h.kernel...)
	for name := range h.records {
		left = append(left, "state record "+name)
	}
	for _, v := range n.vols {
		if _, err := os.Lstat(v.target); err == nil {
			left = append(left, "target "+v.target)
		}
	}
	if len(left) > 0 {
		n.t.Fatalf("left on the node:\n\t%s\nberth log:\n%s", strings.Join(left, "\n\t"), n.logs)
	}
}

func (n *node) cleanup() {
	n.stop()
	h := n.host()
	for i := len(h.mounts) - 1; i >= 0; i-- {
		_ = unix.Unmount(h.mounts[i], unix.MNT_DETACH)
	}
	n.release()
}

// hasCapSysResource reports whether this process may grow a mounted
// ext4 (resize2fs needs CAP_SYS_RESOURCE, which root lacks on some
// hosts).
func hasCapSysResource() bool {
	var hdr = unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[0].Effective&(1<<unix.CAP_SYS_RESOURCE) != 0
}

// Volumes that v0.1.0 staged and published (ext4, xfs, raw block) are
// carried on by today's berth after a restart on the same state: stats,
// expand, unpublish, unstage, and a new stage, with the data intact and
// nothing left on the node.
func TestUpgradeFromV010(t *testing.T) {
	prerequisites(t)
	old, cur := buildV010(t), currentBinary(t)
	upgradeFromV010(t, newFileNode(t), old, cur)
}

// Today's state shown to v0.1.0 (a rollback with volumes staged): see
// rollbackToV010.
func TestRollbackToV010(t *testing.T) {
	prerequisites(t)
	old, cur := buildV010(t), currentBinary(t)
	rollbackToV010(t, newFileNode(t), old, cur)
}

// upgradeFromV010 has v0.1.0 (old) stage, publish and write every volume
// of n, and today's berth (cur), started on the same state, carry them
// on: stats, expand, unpublish, unstage, and a new stage and publish,
// with the data intact and nothing left on the node.
func upgradeFromV010(t *testing.T, n *node, old, cur string) {
	if !n.start(old) {
		t.Fatalf("v0.1.0 exited at start:\n%s", n.logs)
	}
	n.lifecycleStart()
	n.stop()
	before := n.host()
	if len(before.records) != len(n.vols) || len(before.kernel) != n.wantKernel {
		t.Fatalf("after v0.1.0: records %v, kernel objects %v (want %d)", before.records, before.kernel, n.wantKernel)
	}
	if f := before.formats(t); slices.ContainsFunc(f, func(v int) bool { return v != 1 }) {
		t.Fatalf("v0.1.0's records in formats %v, want 1", f)
	}
	t.Logf("v0.1.0 left %d records in format 1, %d mounts, kernel objects:\n\t%s", len(before.records), len(before.mounts), strings.Join(before.kernel, "\n\t"))

	if !n.start(cur) {
		t.Fatalf("today's berth exited at start on v0.1.0's state:\n%s", n.logs)
	}
	for _, v := range n.vols {
		r, err := n.stats(v)
		n.ok("NodeGetVolumeStats", v, err)
		if c := r.GetVolumeCondition(); c.GetAbnormal() {
			t.Fatalf("%s: abnormal after the upgrade: %s", v.id, c.GetMessage())
		}
		if v.fsType != "ext4" || hasCapSysResource() {
			n.ok("NodeExpandVolume", v, n.expand(v))
		} else {
			t.Logf("%s: not expanded: no CAP_SYS_RESOURCE, without which the kernel grows no mounted ext4", v.id)
		}
		n.ok("read after the upgrade", v, n.check(v))
	}
	n.lifecycleEnd()
	// v0.1.0 made the targets; its records say so in their format.
	n.requireNothingLeft()
	n.lifecycleStartAgain()
	if f := n.host().formats(t); slices.ContainsFunc(f, func(v int) bool { return v != 2 }) {
		t.Fatalf("today's records in formats %v, want 2", f)
	}
	marks, err := os.ReadDir(filepath.Join(n.state, "filesystems"))
	must(t, err)
	for _, m := range marks {
		b, err := os.ReadFile(filepath.Join(n.state, "filesystems", m.Name()))
		must(t, err)
		if !strings.Contains(string(b), `"version":2`) || !strings.Contains(string(b), `"made":false`) {
			t.Errorf("filesystem mark %s: %s; want format 2, of a filesystem found (v0.1.0 made it)", m.Name(), b)
		}
	}
	if want := n.filesystems(); len(marks) != want {
		t.Errorf("%d filesystem marks, want one per filesystem volume (%d)", len(marks), want)
	}
	n.lifecycleEnd()
	n.stop()
	n.requireNothingLeft()
}

// filesystems is how many of the node's volumes have a filesystem.
func (n *node) filesystems() int {
	c := 0
	for _, v := range n.vols {
		if v.fsType != "" {
			c++
		}
	}
	return c
}

// lifecycleStartAgain stages and publishes every volume again and reads
// back its data.
func (n *node) lifecycleStartAgain() {
	n.t.Helper()
	for _, v := range n.vols {
		n.ok("NodeStageVolume again", v, n.stage(v))
		n.ok("NodePublishVolume again", v, n.publish(v))
		n.ok("read after a new stage", v, n.check(v))
	}
}

// rollbackToV010 shows today's state to v0.1.0 (a rollback with volumes
// staged): v0.1.0 does not check the format version, so it starts and
// reads today's records as its own. What it must not do is drop a
// record or unmount or detach anything on its own. A record v0.1.0
// writes again (a raw block volume's, at unpublish and publish) is in
// format 1, and today's berth carries it on. A record in a newer format
// than today's is refused by today's berth, kept as it is.
func rollbackToV010(t *testing.T, n *node, old, cur string) {
	if !n.start(cur) {
		t.Fatalf("berth exited at start:\n%s", n.logs)
	}
	n.lifecycleStart()
	n.stop()
	before := n.host()

	started := n.start(old)
	if started {
		for _, v := range n.vols {
			_, err := n.stats(v)
			t.Logf("v0.1.0 NodeGetVolumeStats %s on today's record: %v", v.id, err)
		}
	}
	n.stop()
	t.Logf("v0.1.0 on today's state (started: %t):\n%s", started, n.logs)
	after := n.host()
	if !slices.Equal(after.mounts, before.mounts) || !slices.Equal(after.kernel, before.kernel) {
		t.Fatalf("v0.1.0 changed the node:\nmounts %v\nwere %v\nkernel objects %v\nwere %v", after.mounts, before.mounts, after.kernel, before.kernel)
	}
	for name, b := range before.records {
		if after.records[name] != b {
			t.Fatalf("v0.1.0 changed record %s:\n%s\nwas\n%s", name, after.records[name], b)
		}
	}

	// A record v0.1.0 writes again is in format 1, without what it did
	// not know; today's berth carries it on (below) as it does
	// v0.1.0's own.
	if !n.start(old) {
		t.Fatalf("v0.1.0 exited at start:\n%s", n.logs)
	}
	for _, blk := range n.vols {
		if blk.fsType != "" {
			continue
		}
		n.ok("v0.1.0 NodeUnpublishVolume", blk, n.unpublish(blk))
		n.ok("v0.1.0 NodePublishVolume", blk, n.publish(blk))
		n.ok("read after v0.1.0's publish", blk, n.check(blk))
	}
	n.stop()
	rewritten := n.host()
	if f := rewritten.formats(t); !slices.Contains(f, 1) {
		t.Fatalf("after v0.1.0's publish, records in formats %v; want v0.1.0's in 1", f)
	}

	// A record from a newer berth: kept, named at start, its volume's
	// calls refused; restored to today's format, it is read again.
	v := n.vols[0]
	var file string
	for name, b := range before.records {
		if strings.Contains(b, `"volumeID":"`+v.id+`"`) {
			file = filepath.Join(n.state, "volumes", name)
		}
	}
	newer := strings.Replace(before.records[filepath.Base(file)], `"version":2`, `"version":3`, 1)
	must(t, os.WriteFile(file, []byte(newer), 0o600))
	if !n.start(cur) {
		t.Fatalf("berth exited at start with a newer record:\n%s", n.logs)
	}
	if !strings.Contains(n.logs.String(), "written by a newer berth") {
		t.Fatalf("no start-up line about the newer record:\n%s", n.logs)
	}
	err := n.unpublish(v)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "format 3") {
		t.Fatalf("unpublish of the volume of a newer record: %v", err)
	}
	t.Logf("today's berth on a format 3 record: %v", err)
	if b, _ := os.ReadFile(file); string(b) != newer || !slices.Equal(n.host().mounts, rewritten.mounts) {
		t.Fatalf("the newer record or its mounts changed: %s", b)
	}
	must(t, os.WriteFile(file, []byte(before.records[filepath.Base(file)]), 0o600))

	for _, v := range n.vols {
		n.ok("read after the rollback", v, n.check(v))
	}
	n.lifecycleEnd()
	n.stop()
	n.requireNothingLeft()
}
