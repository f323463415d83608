package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/testutil"
)

const mib = 1 << 20

// harness runs a real Agent on a unix socket in a temporary directory
// and talks to it through a real gRPC client.
type harness struct {
	t        testing.TB
	dir      string
	root     string // file root
	stateDir string
	endpoint string
	node     csi.NodeClient
	identity csi.IdentityClient
	agent    *Agent
	stop     func()
}

func newHarness(t testing.TB, mods ...func(*Config)) *harness {
	t.Helper()
	testutil.RequireRoot(t, "loop devices, mounts", "mkfs.ext4", "mkfs.xfs", "blkid", "e2fsck")
	dir := t.TempDir()
	h := &harness{t: t, dir: dir, root: filepath.Join(dir, "images"), stateDir: filepath.Join(dir, "state")}
	if err := os.Mkdir(h.root, 0o700); err != nil {
		t.Fatal(err)
	}
	h.endpoint = "unix://" + filepath.Join(dir, "csi.sock")
	h.start(mods...)
	t.Cleanup(h.cleanup)
	return h
}

func (h *harness) start(mods ...func(*Config)) {
	t := h.t
	// Each start is a new berth process: its own uevent listener, which
	// the agent and the file transport share, as in berth serve.
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		NodeID:     "test-node",
		StateDir:   h.stateDir,
		Listener:   l,
		Transports: []Transport{fileTransport(t, h.root, l)},
		Version:    "test",
		Logger:     slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: logLevel()})),
	}
	for _, m := range mods {
		m(&cfg)
	}
	a, err := New(cfg)
	if err != nil {
		l.Close()
		t.Fatal(err)
	}
	h.agent = a
	lis, err := Listen(h.endpoint)
	if err != nil {
		a.Close()
		l.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	a.cfg.OnReady = func() { close(ready) }
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx, lis) }()
	<-ready
	conn, err := grpc.NewClient(h.endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	h.node, h.identity = csi.NewNodeClient(conn), csi.NewIdentityClient(conn)
	h.stop = func() {
		conn.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		l.Close()
	}
}

// cleanup undoes whatever a failed test left: mounts below dir, loop
// devices of the images.
func (h *harness) cleanup() {
	if h.stop != nil {
		h.stop()
		h.stop = nil
	}
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], h.dir+"/") {
			mounts = append(mounts, f[4])
		}
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := syscall.Unmount(mounts[i], syscall.MNT_DETACH); err == nil {
			h.t.Errorf("test left %s mounted", mounts[i])
		}
	}
	// Every loop device backed by an image of this test, deleted or not.
	entries, _ := os.ReadDir("/sys/class/block")
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if d, err := (devices.Roots{}).Lookup(e.Name()); err == nil && strings.HasPrefix(d.ID.BackingFile, h.root+"/") {
			h.t.Errorf("test left %s attached to %s", d.ID.BackingFile, d.Path)
			_ = devices.DetachLoop(d)
		}
	}
}

// logLevel is info unless BERTH_TEST_DEBUG asks for every request.
func logLevel() slog.Level {
	if os.Getenv("BERTH_TEST_DEBUG") != "" {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// image creates a sparse image file of size bytes in the file root.
func (h *harness) image(name string, size int64) string {
	h.t.Helper()
	p := filepath.Join(h.root, name)
	f, err := os.Create(p)
	if err != nil {
		h.t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		h.t.Fatal(err)
	}
	return p
}

func (h *harness) mkdir(name string) string {
	h.t.Helper()
	p := filepath.Join(h.dir, name)
	if err := os.MkdirAll(p, 0o750); err != nil {
		h.t.Fatal(err)
	}
	return p
}

func mountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

const snw = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

// twice calls an RPC twice and checks both answers agree: the CSI
// idempotency rule.
func twice[Req any, Resp proto.Message](t *testing.T, name string, call func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	r1, err1 := call(ctx, req)
	d := time.Since(start)
	r2, err2 := call(ctx, req)
	if status.Code(err1) != status.Code(err2) {
		t.Fatalf("%s: first call %v, repeated call %v", name, err1, err2)
	}
	if err1 == nil && !proto.Equal(r1, r2) {
		t.Fatalf("%s: first answer %v, repeated answer %v", name, r1, r2)
	}
	t.Logf("%s: %v in %v (repeat agrees)", name, status.Code(err1), d)
	return r1, err1
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("%s: got %v (%v), want %v", what, got, err, want)
	}
}

func must(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

type vol struct {
	id, staging, target string
	vctx                map[string]string
	cap                 *csi.VolumeCapability
}

func (h *harness) stage(v vol) error {
	_, err := twice(h.t.(*testing.T), "NodeStageVolume", h.node.NodeStageVolume, &csi.NodeStageVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx,
	})
	return err
}

func (h *harness) publish(v vol, ro bool) error {
	_, err := twice(h.t.(*testing.T), "NodePublishVolume", h.node.NodePublishVolume, &csi.NodePublishVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap, VolumeContext: v.vctx, Readonly: ro,
	})
	return err
}

func (h *harness) unpublish(v vol) error {
	_, err := twice(h.t.(*testing.T), "NodeUnpublishVolume", h.node.NodeUnpublishVolume, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
	return err
}

func (h *harness) unstage(v vol) error {
	_, err := twice(h.t.(*testing.T), "NodeUnstageVolume", h.node.NodeUnstageVolume, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	return err
}

func (h *harness) newVol(name string, size int64, c *csi.VolumeCapability) vol {
	h.image(name+".img", size)
	return vol{
		id:      "vol-" + name,
		staging: h.mkdir("staging/" + name),
		target:  filepath.Join(h.mkdir("pods/"+name), "mount"),
		vctx:    map[string]string{"file": name + ".img"},
		cap:     c,
	}
}

func TestLifecycleMount(t *testing.T) {
	for _, tc := range []struct {
		fsType string
		size   int64
	}{
		{"ext4", 64 * mib},
		{"xfs", 300 * mib}, // mkfs.xfs refuses filesystems below 300 MiB
	} {
		t.Run(tc.fsType, func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("data", tc.size, mountCap(tc.fsType, snw))
			must(t, "stage", h.stage(v))
			must(t, "publish", h.publish(v, false))
			payload := []byte("berth keeps this across unstage and stage\n")
			must(t, "write", os.WriteFile(filepath.Join(v.target, "hello"), payload, 0o644))

			st, err := twice(t, "NodeGetVolumeStats", h.node.NodeGetVolumeStats, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
			must(t, "stats", err)
			if len(st.Usage) != 2 || st.Usage[0].Total < tc.size/2 || st.Usage[1].Unit != csi.VolumeUsage_INODES || st.Usage[1].Used == 0 {
				t.Fatalf("stats: %v", st)
			}
			if st.VolumeCondition.GetAbnormal() {
				t.Fatalf("stats: abnormal condition %v", st.VolumeCondition)
			}

			must(t, "unpublish", h.unpublish(v))
			if _, err := os.Lstat(v.target); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("target path still exists after unpublish: %v", err)
			}
			must(t, "unstage", h.unstage(v))
			if d, err := (devices.Roots{}).FindLoop(filepath.Join(h.root, "data.img")); err == nil {
				t.Fatalf("image still attached to %s after unstage", d.Path)
			}
			if n := len(stateFiles(t, h)); n != 0 {
				t.Fatalf("%d state files after unstage", n)
			}

			must(t, "restage", h.stage(v))
			must(t, "republish", h.publish(v, false))
			got, err := os.ReadFile(filepath.Join(v.target, "hello"))
			must(t, "read after restage", err)
			if !bytes.Equal(got, payload) {
				t.Fatalf("data after restage: %q, want %q", got, payload)
			}
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
		})
	}
}

func stateFiles(t *testing.T, h *harness) []string {
	m, err := filepath.Glob(filepath.Join(h.stateDir, "volumes", "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestLifecycleBlock(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("raw", 16*mib, blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER))
	v.target = filepath.Join(filepath.Dir(v.target), "dev")
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	fi, err := os.Stat(v.target)
	must(t, "stat target", err)
	if fi.Mode()&os.ModeDevice == 0 {
		t.Fatalf("target %s is %v, want the block device", v.target, fi.Mode())
	}
	pattern := bytes.Repeat([]byte("berth-block!"), 4096/12+1)[:4096]
	f, err := os.OpenFile(v.target, os.O_WRONLY, 0)
	must(t, "open target", err)
	_, err = f.WriteAt(pattern, 8*mib)
	must(t, "write target", err)
	must(t, "fsync target", f.Sync())
	f.Close()

	st, err := twice(t, "NodeGetVolumeStats", h.node.NodeGetVolumeStats, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
	must(t, "stats", err)
	if len(st.Usage) != 1 || st.Usage[0].Total != 16*mib {
		t.Fatalf("block stats: %v", st)
	}
	must(t, "unpublish", h.unpublish(v))
	if _, err := os.Lstat(v.target); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("target file still exists after unpublish: %v", err)
	}
	must(t, "unstage", h.unstage(v))

	img, err := os.Open(filepath.Join(h.root, "raw.img"))
	must(t, "open image", err)
	defer img.Close()
	got := make([]byte, len(pattern))
	_, err = img.ReadAt(got, 8*mib)
	must(t, "read image", err)
	if !bytes.Equal(got, pattern) {
		t.Fatal("bytes written through the published block device are not in the image")
	}
}

const capSysResource = 24

// hasCapability reports whether the test process has capability bit c
// in its effective set.
func hasCapability(t *testing.T, c uint) bool {
	b, err := os.ReadFile("/proc/self/status")
	must(t, "read /proc/self/status", err)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			must(t, "parse CapEff", err)
			return n&(1<<c) != 0
		}
	}
	t.Fatal("no CapEff in /proc/self/status")
	return false
}

func statTotal(t *testing.T, h *harness, v vol) int64 {
	t.Helper()
	st, err := h.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
	must(t, "stats", err)
	return st.Usage[0].Total
}

func TestForeignDataIsRefused(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("foreign", 64*mib, mountCap("ext4", snw))
	img := filepath.Join(h.root, "foreign.img")
	junk := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 1024)
	f, err := os.OpenFile(img, os.O_WRONLY, 0)
	must(t, "open image", err)
	_, err = f.WriteAt(junk, 4096)
	must(t, "write junk", err)
	f.Close()
	before, err := os.ReadFile(img)
	must(t, "read image", err)

	err = h.stage(v)
	wantCode(t, "stage over foreign data", err, codes.FailedPrecondition)
	// The refusal names what the operator can check: the volume and its
	// image, not the loop device the failed stage detached.
	if msg := err.Error(); !strings.Contains(msg, `volume "`+v.id+`" (file `+img+`)`) {
		t.Errorf("refusal %q does not name the volume and its image", msg)
	}
	after, err := os.ReadFile(img)
	must(t, "read image", err)
	if !bytes.Equal(before, after) {
		t.Fatal("stage changed the bytes of a device holding foreign data")
	}
	if d, err := (devices.Roots{}).FindLoop(img); err == nil {
		t.Fatalf("failed stage left %s attached", d.Path)
	}
	if n := len(stateFiles(t, h)); n != 0 {
		t.Fatalf("failed stage left %d state files", n)
	}
	// Another filesystem than the one asked for is foreign too.
	v2 := h.newVol("other-fs", 300*mib, mountCap("xfs", snw))
	must(t, "stage xfs", h.stage(v2))
	must(t, "unstage xfs", h.unstage(v2))
	v2.id, v2.cap = "vol-other-fs-as-ext4", mountCap("ext4", snw)
	wantCode(t, "stage xfs image as ext4", h.stage(v2), codes.FailedPrecondition)
}

func TestConflicts(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxVolumes = 2 })
	ctx := context.Background()
	v := h.newVol("a", 64*mib, mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER))
	must(t, "stage", h.stage(v))

	restage := func(mod func(*csi.NodeStageVolumeRequest)) error {
		req := &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx}
		mod(req)
		_, err := h.node.NodeStageVolume(ctx, req)
		return err
	}
	wantCode(t, "restage as xfs", restage(func(r *csi.NodeStageVolumeRequest) {
		r.VolumeCapability = mountCap("xfs", r.VolumeCapability.AccessMode.Mode)
	}), codes.AlreadyExists)
	wantCode(t, "restage with another mode", restage(func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = mountCap("ext4", snw) }), codes.AlreadyExists)
	wantCode(t, "restage as block", restage(func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = blockCap(snw) }), codes.AlreadyExists)
	h.image("b.img", 64*mib)
	wantCode(t, "restage from another image", restage(func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = map[string]string{"file": "b.img"} }), codes.AlreadyExists)
	wantCode(t, "restage at another path", restage(func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = h.mkdir("staging/elsewhere") }), codes.FailedPrecondition)
	wantCode(t, "another volume on the same staging path", restage(func(r *csi.NodeStageVolumeRequest) {
		r.VolumeId = "vol-b"
		r.VolumeContext = map[string]string{"file": "b.img"}
	}), codes.AlreadyExists)
	wantCode(t, "another volume from the same image", restage(func(r *csi.NodeStageVolumeRequest) {
		r.VolumeId = "vol-b"
		r.StagingTargetPath = h.mkdir("staging/b")
	}), codes.FailedPrecondition)

	must(t, "publish", h.publish(v, false))
	other := filepath.Join(filepath.Dir(v.target), "other")
	_, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: other, VolumeCapability: v.cap})
	wantCode(t, "second target of a SINGLE_NODE_SINGLE_WRITER volume", err, codes.FailedPrecondition)
	wantCode(t, "unstage while published", h.unstage(v), codes.FailedPrecondition)

	// Max volumes: a and b fill the node, c is refused.
	b := vol{id: "vol-b", staging: h.mkdir("staging/b"), vctx: map[string]string{"file": "b.img"}, cap: mountCap("ext4", snw)}
	must(t, "stage b", h.stage(b))
	_, err = h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: b.id, StagingTargetPath: b.staging, TargetPath: v.target, VolumeCapability: b.cap})
	wantCode(t, "publish b at a's target", err, codes.AlreadyExists)
	c := h.newVol("c", 64*mib, mountCap("ext4", snw))
	wantCode(t, "stage beyond --max-volumes", h.stage(c), codes.ResourceExhausted)
	info, err := h.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	must(t, "NodeGetInfo", err)
	if info.MaxVolumesPerNode != 2 || info.NodeId != "test-node" {
		t.Fatalf("NodeGetInfo: %v", info)
	}

	must(t, "unstage b", h.unstage(b))
	must(t, "unpublish", h.unpublish(v))
	must(t, "unstage", h.unstage(v))
}

func TestBadRequests(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	v := h.newVol("v", 64*mib, mountCap("ext4", snw))
	outside := t.TempDir()
	link := filepath.Join(h.dir, "link")
	must(t, "symlink", os.Symlink(outside, link))
	must(t, "symlink image", os.Symlink("/etc/passwd", filepath.Join(h.root, "passwd.img")))

	stage := func(mod func(*csi.NodeStageVolumeRequest)) error {
		req := &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: proto.Clone(v.cap).(*csi.VolumeCapability), VolumeContext: v.vctx}
		mod(req)
		_, err := h.node.NodeStageVolume(ctx, req)
		return err
	}
	for _, tc := range []struct {
		name string
		mod  func(*csi.NodeStageVolumeRequest)
		want codes.Code
	}{
		{"no volume_id", func(r *csi.NodeStageVolumeRequest) { r.VolumeId = "" }, codes.InvalidArgument},
		{"no staging path", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = "" }, codes.InvalidArgument},
		{"relative staging path", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = "staging/v" }, codes.InvalidArgument},
		{"staging path with ..", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = v.staging + "/../v" }, codes.InvalidArgument},
		{"staging path with newline", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = v.staging + "\nx" }, codes.InvalidArgument},
		{"staging path through a symlink", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = link + "/x" }, codes.InvalidArgument},
		{"staging path is a symlink", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = link }, codes.InvalidArgument},
		{"missing staging path", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = v.staging + "-missing" }, codes.NotFound},
		{"no capability", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = nil }, codes.InvalidArgument},
		{"no access mode", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability.AccessMode = nil }, codes.InvalidArgument},
		{"unknown fs type", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = mountCap("ntfs", snw) }, codes.InvalidArgument},
		{"disallowed mount option", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = mountCap("ext4", snw, "errors=panic") }, codes.InvalidArgument},
		{"multi-node writer on a filesystem", func(r *csi.NodeStageVolumeRequest) {
			r.VolumeCapability = mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
		}, codes.InvalidArgument},
		{"no transport", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = nil }, codes.InvalidArgument},
		{"image outside the root", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = map[string]string{"file": "../../etc/passwd"} }, codes.InvalidArgument},
		{"absolute image outside the root", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = map[string]string{"file": "/etc/passwd"} }, codes.InvalidArgument},
		{"image through a symlink", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = map[string]string{"file": "passwd.img"} }, codes.InvalidArgument},
		{"missing image", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = map[string]string{"file": "nope.img"} }, codes.NotFound},
		{"shell metacharacters", func(r *csi.NodeStageVolumeRequest) {
			r.VolumeContext = map[string]string{"file": "$(reboot);`id`|x.img"}
		}, codes.NotFound},
		{"transport not enabled", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext = map[string]string{"transport": "iscsi"} }, codes.InvalidArgument},
	} {
		t.Run("stage/"+tc.name, func(t *testing.T) {
			wantCode(t, tc.name, stage(tc.mod), tc.want)
		})
	}
	if n := len(stateFiles(t, h)); n != 0 {
		t.Fatalf("bad requests left %d state files", n)
	}

	// Calls for volumes this node does not know.
	_, err := h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "unknown", StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap})
	wantCode(t, "publish unstaged", err, codes.FailedPrecondition)
	_, err = h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "unknown", TargetPath: v.target, VolumeCapability: v.cap})
	wantCode(t, "publish without staging path", err, codes.FailedPrecondition)
	_, err = h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "unknown", StagingTargetPath: v.staging, TargetPath: "/tmp/../etc", VolumeCapability: v.cap})
	wantCode(t, "publish to an unclean path", err, codes.InvalidArgument)
	_, err = twice(t, "NodeUnpublishVolume", h.node.NodeUnpublishVolume, &csi.NodeUnpublishVolumeRequest{VolumeId: "unknown", TargetPath: v.target})
	wantCode(t, "unpublish unknown", err, codes.OK)
	_, err = twice(t, "NodeUnstageVolume", h.node.NodeUnstageVolume, &csi.NodeUnstageVolumeRequest{VolumeId: "unknown", StagingTargetPath: v.staging})
	wantCode(t, "unstage unknown", err, codes.OK)
	_, err = twice(t, "NodeGetVolumeStats", h.node.NodeGetVolumeStats, &csi.NodeGetVolumeStatsRequest{VolumeId: "unknown", VolumePath: v.staging})
	wantCode(t, "stats unknown", err, codes.NotFound)
	_, err = twice(t, "NodeExpandVolume", h.node.NodeExpandVolume, &csi.NodeExpandVolumeRequest{VolumeId: "unknown", VolumePath: v.staging})
	wantCode(t, "expand unknown", err, codes.NotFound)
	_, err = h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "unknown"})
	wantCode(t, "stats without path", err, codes.InvalidArgument)
	_, err = h.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumePath: v.staging})
	wantCode(t, "expand without id", err, codes.InvalidArgument)

	// A staged volume answers stats only for its own paths.
	must(t, "stage", h.stage(v))
	_, err = h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: "/"})
	wantCode(t, "stats of a foreign path", err, codes.NotFound)
	_, err = twice(t, "NodeGetVolumeStats", h.node.NodeGetVolumeStats, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.staging})
	must(t, "stats of the staging path", err)
	must(t, "unstage", h.unstage(v))
}

func TestIdentity(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Topology = map[string]string{"topology.berth.csi.io/node": "n1"}
		c.ReadyFunc = func(context.Context) error { return nil }
	})
	ctx := context.Background()
	info, err := twice(t, "GetPluginInfo", h.identity.GetPluginInfo, &csi.GetPluginInfoRequest{})
	must(t, "GetPluginInfo", err)
	if info.Name != DefaultDriverName || info.VendorVersion != "test" {
		t.Fatalf("GetPluginInfo: %v", info)
	}
	caps, err := h.identity.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	must(t, "GetPluginCapabilities", err)
	var topo, online bool
	for _, c := range caps.Capabilities {
		if c.GetService().GetType() == csi.PluginCapability_Service_CONTROLLER_SERVICE {
			t.Fatal("berth advertises a controller service")
		}
		topo = topo || c.GetService().GetType() == csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS
		online = online || c.GetVolumeExpansion().GetType() == csi.PluginCapability_VolumeExpansion_ONLINE
	}
	if !topo || !online {
		t.Fatalf("GetPluginCapabilities: %v", caps)
	}
	p, err := twice(t, "Probe", h.identity.Probe, &csi.ProbeRequest{})
	must(t, "Probe", err)
	if !p.GetReady().GetValue() {
		t.Fatal("Probe: not ready")
	}
	ni, err := h.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	must(t, "NodeGetInfo", err)
	if ni.AccessibleTopology.GetSegments()["topology.berth.csi.io/node"] != "n1" {
		t.Fatalf("NodeGetInfo: %v", ni)
	}
	nc, err := h.node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	must(t, "NodeGetCapabilities", err)
	if len(nc.Capabilities) != 5 {
		t.Fatalf("NodeGetCapabilities: %v", nc)
	}
}

func TestProbeReportsReadyFunc(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.ReadyFunc = func(context.Context) error { return errors.New("iscsid is not running") }
	})
	_, err := h.identity.Probe(context.Background(), &csi.ProbeRequest{})
	wantCode(t, "Probe", err, codes.FailedPrecondition)
	if !strings.Contains(err.Error(), "iscsid is not running") {
		t.Fatalf("Probe error %v does not carry the check's message", err)
	}
}

// A restarted agent finds its volumes in the state directory.
func TestRestartKeepsState(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("keep", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	h.stop()
	h.start()
	must(t, "publish after restart", h.publish(v, false))
	must(t, "unpublish after restart", h.unpublish(v))
	must(t, "unstage after restart", h.unstage(v))
}

// The socket is private to root's group, and a second server does not
// take over a live one's socket.
func TestListen(t *testing.T) {
	h := newHarness(t)
	path, _ := SocketPath(h.endpoint)
	fi, err := os.Stat(path)
	must(t, "stat socket", err)
	if fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket mode %v, want 0660", fi.Mode().Perm())
	}
	if _, err := Listen(h.endpoint); err == nil || !strings.Contains(err.Error(), "in use by another berth") {
		t.Fatalf("Listen on a live berth's socket: %v", err)
	}
	h.stop()
	h.stop = nil
	// A server that holds no endpoint lock keeps its socket too.
	other, err := net.Listen("unix", path)
	must(t, "other server's listen", err)
	other.(*net.UnixListener).SetUnlinkOnClose(false)
	if _, err := Listen(h.endpoint); err == nil || !strings.Contains(err.Error(), "another server") {
		t.Fatalf("Listen on another server's live socket: %v", err)
	}
	// Once it is gone, its socket file is stale and replaced.
	other.Close()
	l, err := Listen(h.endpoint)
	must(t, "Listen over a stale socket", err)
	l.Close()
}

var _ = io.EOF
var _ = errdefs.ErrNotFound

// mountsAt counts the mounts stacked at p.
func mountsAt(t *testing.T, p string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	must(t, "read mountinfo", err)
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == p {
			n++
		}
	}
	return n
}

// An agent that crashed at any point of a stage or publish finishes or
// undoes the work when the CO retries, without stacking mounts.
func TestCrashRecovery(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("crash", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))

	// Crash after the mounts, before the records said so.
	h.stop()
	st, err := openStore(filepath.Join(h.stateDir, "volumes"))
	must(t, "open state", err)
	rec, ok := st.get(v.id)
	if !ok {
		t.Fatal("no record")
	}
	rec.Staged = false
	must(t, "rewind state", st.put(rec))
	h.start()
	must(t, "stage after crash", h.stage(v))
	must(t, "publish after crash", h.publish(v, false))
	if n := mountsAt(t, v.staging); n != 1 {
		t.Fatalf("%d mounts at the staging path, want 1", n)
	}
	if n := mountsAt(t, v.target); n != 1 {
		t.Fatalf("%d mounts at the target path, want 1", n)
	}

	// Crash after recording a publish, before mounting it.
	other := filepath.Join(filepath.Dir(v.target), "other")
	rec, _ = h.recordOf(v.id)
	rec.Publishes[other] = publishRecord{Mode: snw.String()}
	h.stop()
	st, _ = openStore(filepath.Join(h.stateDir, "volumes"))
	must(t, "record publish intent", st.put(rec))
	h.start()
	// Unstage refuses while a real publish exists, then drops the stale
	// one once the real one is gone.
	wantCode(t, "unstage while published", h.unstage(v), codes.FailedPrecondition)
	must(t, "unpublish", h.unpublish(v))
	must(t, "unstage", h.unstage(v))

	// Crash after the intent record, before anything was attached.
	h.stop()
	st, _ = openStore(filepath.Join(h.stateDir, "volumes"))
	must(t, "intent record", st.put(&volumeRecord{VolumeID: v.id, Transport: "file", Context: v.vctx, TargetKey: filepath.Join(h.root, "crash.img"), AccessType: "mount", FsType: "ext4", Mode: snw.String(), StagingPath: v.staging}))
	h.start()
	must(t, "unstage of an intent", h.unstage(v))
	if n := len(stateFiles(t, h)); n != 0 {
		t.Fatalf("%d state files left", n)
	}
}

func (h *harness) recordOf(id string) (*volumeRecord, bool) {
	st, err := openStore(filepath.Join(h.stateDir, "volumes"))
	if err != nil {
		h.t.Fatal(err)
	}
	return st.get(id)
}
