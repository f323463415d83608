package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
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

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/testutil"
)

// berthBinary returns $BERTH_BIN, or builds berth from this module.
func berthBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("BERTH_BIN"); p != "" {
		return p
	}
	bin := filepath.Join(t.TempDir(), "berth")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build berth: %v\n%s", err, out)
	}
	return bin
}

// lockedBuffer collects a child's output.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// berthProc is a `berth serve` process with the file transport, in its
// own process group.
type berthProc struct {
	cmd  *exec.Cmd
	logs *lockedBuffer
	node csi.NodeClient
	conn *grpc.ClientConn
}

// startBerthProc starts berth on dir's socket, state and image root.
// binds, when given, are bind mounts (target: source) made for berth
// alone: it is started as this test binary, which makes them in a mount
// namespace of its own and then executes berth (see init).
func startBerthProc(t *testing.T, bin, dir string, binds map[string]string) *berthProc {
	t.Helper()
	sock := filepath.Join(dir, "csi.sock")
	p := &berthProc{logs: &lockedBuffer{}}
	args := []string{"serve", "--endpoint", "unix://" + sock, "--node-id", "crash-node",
		"--state-dir", filepath.Join(dir, "state"), "--file-root", filepath.Join(dir, "images")}
	p.cmd = exec.Command(bin, args...)
	if len(binds) > 0 {
		self, err := os.Executable()
		must(t, "find the test binary", err)
		p.cmd = exec.Command(self, args...)
		var spec []string
		for target, source := range binds {
			spec = append(spec, target+"="+source)
		}
		p.cmd.Env = append(os.Environ(), execInMountNSEnv+"="+bin, bindsEnv+"="+strings.Join(spec, ":"))
	}
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.kill() })
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	p.conn = conn
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	id := csi.NewIdentityClient(conn)
	for {
		r, err := id.Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		if err == nil && r.GetReady().GetValue() {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("berth not ready: %v\n%s", err, p.logs)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
	p.node = csi.NewNodeClient(conn)
	return p
}

// When execInMountNSEnv names a program, this test binary is only a
// launcher: it makes the bind mounts bindsEnv lists
// ("target=source:..."), in a private mount namespace, and executes the
// program with its own arguments. init runs on the main thread, whose
// namespace the executed program keeps.
const (
	execInMountNSEnv = "BERTH_TEST_EXEC_IN_MOUNT_NS"
	bindsEnv         = "BERTH_TEST_BINDS"
)

func init() {
	bin := os.Getenv(execInMountNSEnv)
	if bin == "" {
		return
	}
	runtime.LockOSThread()
	fail := func(what string, err error) {
		fmt.Fprintf(os.Stderr, "launcher: %s: %v\n", what, err)
		os.Exit(2)
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		fail("unshare mount namespace", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		fail("make mounts private", err)
	}
	for _, b := range strings.Split(os.Getenv(bindsEnv), ":") {
		target, source, _ := strings.Cut(b, "=")
		if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
			fail("bind "+source+" on "+target, err)
		}
	}
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, execInMountNSEnv+"=") && !strings.HasPrefix(e, bindsEnv+"=") {
			env = append(env, e)
		}
	}
	fail("exec "+bin, unix.Exec(bin, append([]string{bin}, os.Args[1:]...), env))
}

// kill ends berth and every process of its group (its mkfs) with
// SIGKILL, as a node crash or a container kill does.
func (p *berthProc) kill() {
	if p.cmd.ProcessState != nil {
		return
	}
	if p.conn != nil {
		p.conn.Close()
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// detachImages detaches the loop devices of images below root that a
// failed test left.
func detachImages(t *testing.T, root string) {
	entries, _ := os.ReadDir("/sys/class/block")
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if d, err := (devices.Roots{}).Lookup(e.Name()); err == nil && strings.HasPrefix(d.ID.BackingFile, root+"/") {
			t.Errorf("test left %s attached to %s", d.ID.BackingFile, d.Path)
			_ = devices.DetachLoop(d)
		}
	}
}

// A berth killed with SIGKILL while mkfs.ext4 runs on a volume's first
// stage leaves mkfs' partial writes; the retried stage, by a restarted
// berth on the same device, finishes the format and mounts the volume.
// mkfs is made slow by a stand-in bound over mkfs.ext4 for the first
// berth alone: it writes a block at 4 KiB, as mke2fs does before its
// superblock, and then waits to be killed.
func TestKilledDuringMkfsFinishesOnRetry(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts", "mkfs.ext4", "blkid", "e2fsck")
	bin := berthBinary(t)
	dir := t.TempDir()
	root := filepath.Join(dir, "images")
	must(t, "mkdir", os.Mkdir(root, 0o700))
	t.Cleanup(func() { detachImages(t, root) })
	img := filepath.Join(root, "crash.img")
	must(t, "create image", os.WriteFile(img, nil, 0o600))
	must(t, "size image", os.Truncate(img, 64*mib))
	staging := filepath.Join(dir, "staging")
	must(t, "mkdir", os.Mkdir(staging, 0o750))
	req := &csi.NodeStageVolumeRequest{VolumeId: "vol-crash", StagingTargetPath: staging,
		VolumeCapability: mountCap("ext4", snw), VolumeContext: map[string]string{"file": "crash.img"}}

	started := filepath.Join(dir, "mkfs-started")
	stub := filepath.Join(dir, "mkfs-stub")
	script := fmt.Sprintf(`#!/bin/sh
for dev; do :; done
dd if=/dev/urandom of="$dev" bs=4096 seek=1 count=1 conv=notrunc oflag=direct status=none || exit 1
: > %s
exec sleep 600
`, started)
	must(t, "write mkfs stub", os.WriteFile(stub, []byte(script), 0o755))
	// berth takes its tools from /usr/sbin first.
	first := startBerthProc(t, bin, dir, map[string]string{"/usr/sbin/mkfs.ext4": stub})
	stageErr := make(chan error, 1)
	go func() {
		_, err := first.node.NodeStageVolume(context.Background(), req)
		stageErr <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(started); err == nil {
			break
		}
		select {
		case err := <-stageErr:
			t.Fatalf("stage returned before mkfs started: %v\n%s", err, first.logs)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("mkfs did not start\n%s", first.logs)
		}
	}
	first.kill()
	<-stageErr
	t.Logf("berth killed during mkfs; its log:\n%s", first.logs)
	h := &harness{t: t, stateDir: filepath.Join(dir, "state")}
	if rec, ok := h.recordOf("vol-crash"); !ok || rec.Formatting == nil || rec.Formatting.BackingFile != img {
		t.Fatalf("record after the crash does not say berth started formatting the image's device: %+v", rec)
	}

	second := startBerthProc(t, bin, dir, nil)
	_, err := second.node.NodeStageVolume(context.Background(), req)
	t.Logf("restarted berth's log:\n%s", second.logs)
	must(t, "stage retried after the crash", err)
	t.Cleanup(func() {
		if _, err := second.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol-crash", StagingTargetPath: staging}); err != nil {
			t.Errorf("unstage: %v", err)
			_ = unix.Unmount(staging, unix.MNT_DETACH)
		}
	})
	if n := mountsAt(t, staging); n != 1 {
		t.Fatalf("%d mounts at the staging path after the retried stage, want 1", n)
	}
	must(t, "write to the volume", os.WriteFile(filepath.Join(staging, "hello"), []byte("hello\n"), 0o644))
	rec, ok := h.recordOf("vol-crash")
	if !ok || !rec.Staged || rec.Formatting != nil {
		t.Fatalf("record after the retried stage: %+v", rec)
	}
}

// A device holding data that berth did not start formatting stays
// refused by the real binary: 4 KiB of random bytes at 4 KiB, what an
// interrupted mkfs leaves, written by someone else.
func TestUnmarkedPartialDataRefused(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts", "mkfs.ext4", "blkid", "e2fsck")
	bin := berthBinary(t)
	dir := t.TempDir()
	root := filepath.Join(dir, "images")
	must(t, "mkdir", os.Mkdir(root, 0o700))
	t.Cleanup(func() { detachImages(t, root) })
	img := filepath.Join(root, "foreign.img")
	must(t, "create image", os.WriteFile(img, nil, 0o600))
	must(t, "size image", os.Truncate(img, 64*mib))
	junk := make([]byte, 4096)
	rand.Read(junk)
	junk[0] |= 1
	f, err := os.OpenFile(img, os.O_WRONLY, 0)
	must(t, "open image", err)
	_, err = f.WriteAt(junk, 4096)
	f.Close()
	must(t, "write junk", err)
	before, err := os.ReadFile(img)
	must(t, "read image", err)
	staging := filepath.Join(dir, "staging")
	must(t, "mkdir", os.Mkdir(staging, 0o750))

	p := startBerthProc(t, bin, dir, nil)
	req := &csi.NodeStageVolumeRequest{VolumeId: "vol-foreign", StagingTargetPath: staging,
		VolumeCapability: mountCap("ext4", snw), VolumeContext: map[string]string{"file": "foreign.img"}}
	for range 2 {
		_, err := p.node.NodeStageVolume(context.Background(), req)
		wantCode(t, "stage over data berth did not start formatting", err, codes.FailedPrecondition)
		if !strings.Contains(err.Error(), "offset 4096") {
			t.Fatalf("refusal %v does not name offset 4096", err)
		}
	}
	after, err := os.ReadFile(img)
	must(t, "read image", err)
	if !bytes.Equal(before, after) {
		t.Fatal("a refused stage changed the image")
	}
	if _, err := os.Stat(filepath.Join(dir, "state", "volumes", stateFileName("vol-foreign"))); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused stage left a record: %v", err)
	}
}
