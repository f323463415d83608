package iscsi_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/file"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/reliability"
	"github.com/berth-csi/berth/test/vm"
)

// TestFaultMultipathISCSIStuckDisk: one iSCSI disk in SCSI error recovery does
// not stall the node. The disk's LUN is a dm-delay map on the target
// side. With the disk's command timeout lowered to 2 s, a delay of
// minutes makes a read time out and its abort time out; the initiator
// drops the session, and the disk's SCSI host stays in error recovery
// until the session logs in again, which the target does not let it do
// while the read is held, or until its replacement timeout (raised to
// 10 min here, from multipathd's 5 s). Every open of the disk waits for
// the recovery meanwhile.
//
// The unstage of that volume waits in the in-use check before the
// disk's removal (blockdev.Held), its first open of the disk. Meanwhile
// a file volume of the same agent stages, publishes, is written,
// unpublishes and unstages, each call within max(3 s, 3x) its time with
// the disk healthy: no exec and no mount of it waits behind the stuck
// open.
//
// What makes the unstage reach that check first: a raw block volume
// (no unmount that would wait for its writes first), unfenced (no
// release that would open its paths first), through a map (on a single
// path the unstage's flush opens the disk first), on a session that
// carries another volume's LUN too (else the unstage logs the failed
// session out, and the disk goes with it).
func TestFaultMultipathISCSIStuckDisk(t *testing.T) {
	vm.RequireGuest(t)
	iscsi.StartMultipathd(t)
	fault := reliability.StartFault(t, "iSCSI disk in SCSI error recovery: a file volume's whole life beside it")
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))
	// Made before the target, so that it goes after it.
	delay := newDelayMap(t, 64<<20)
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddLUNOn(0, delay.path)
	otherWWID := lt.AddLUN(1, 16<<20)
	l := csitest.Listener(t)
	files := &fileVolumes{root: t.TempDir()}
	ft, err := file.New(files.root, l)
	if err != nil {
		t.Fatal(err)
	}
	node := csitest.StartAgent(t, logger, l, iscsiTransport(t, l, logger),
		agent.TransportFunc(agent.TransportKind{Name: file.Name, Keys: file.TransportKeys()}, ft.Parse))
	files.node = fault.Node(node)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	stuck := stageBlock(t, ctx, node, "vol-stuck", lt.IQN, lt.Portal(1), 0, wwid)
	other := stageBlock(t, ctx, node, "vol-other", lt.IQN, lt.Portal(1), 1, otherWWID)
	settle(t)
	dm := multipathMap(t, wwid)
	disk := targetLUNDisk(t, lt.IQN, 0)
	host, session := "/sys/class/scsi_host/host"+strings.Split(disk.ID.HCTL, ":")[0], sessionOf(t, disk)
	t.Logf("iSCSI volume: map %s over %s (%s, %s), write cache %s / %s", dm.Name, disk.Path, disk.ID.HCTL, filepath.Base(session),
		sysAttr("/sys/block/"+dm.Name+"/queue/write_cache"), sysAttr("/sys/block/"+disk.Name+"/queue/write_cache"))

	baseline := map[string]time.Duration{}
	for i := range 2 {
		times, err := files.round(t, fmt.Sprintf("healthy-%d", i))
		if err != nil {
			t.Fatalf("file volume with the iSCSI disk healthy: %v", err)
		}
		for step, took := range times {
			baseline[step] = max(baseline[step], took)
		}
	}

	// The disk's error recovery.
	for attr, v := range map[string]string{"/sys/block/" + disk.Name + "/device/timeout": "2", session + "/recovery_tmo": "600"} {
		if err := os.WriteFile(attr, []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	delay.Stall(t, 10*time.Minute)
	endDelay := sync.OnceFunc(func() {
		if err := delay.Unstall(); err != nil {
			t.Errorf("end the delay: %v", err)
		}
	})
	t.Cleanup(endDelay)
	read := readDirect(disk.Path)
	states := func() string {
		return fmt.Sprintf("host %s, session %s, disk %s", sysAttr(host+"/state"), sysAttr(session+"/state"), sysAttr("/sys/block/"+disk.Name+"/device/state"))
	}
	waitFor(t, 2*time.Minute, host+" to be in error recovery", func() bool { return sysAttr(host+"/state") == "recovery" })
	t.Logf("error recovery: %s", states())

	// The unstage waits half its time for a path, then makes the map
	// fail I/O and removes it, then the disk.
	const unstageDeadline = 20 * time.Second
	type result struct {
		err  error
		took time.Duration
	}
	unstaged := make(chan result, 1)
	go func() {
		uctx, ucancel := context.WithTimeout(ctx, unstageDeadline)
		defer ucancel()
		start := time.Now()
		_, err := node.NodeUnstageVolume(uctx, stuck)
		unstaged <- result{err, time.Since(start)}
	}()
	var held string
	waitFor(t, unstageDeadline, "the unstage to wait in its in-use check's open of "+disk.Path, func() bool {
		held = goroutineInSyscall("internal/blockdev.Held(")
		return held != ""
	})
	t.Logf("the unstage waits in:\n%s", held)
	for _, s := range kernelStacks("sd_open") {
		t.Logf("in the kernel:\n%s", s)
	}

	during, err := files.round(t, "recovery")
	stillHeld, stillRecovering, after := goroutineInSyscall("internal/blockdev.Held(") != "", sysAttr(host+"/state") == "recovery", states()
	endDelay()
	if err != nil {
		t.Errorf("file volume while %s is in error recovery: %v", disk.Path, err)
	}
	for _, step := range fileSteps {
		limit := max(3*time.Second, 3*baseline[step])
		took, ok := during[step]
		if !ok {
			t.Logf("%-20s healthy %8v  in recovery: not run", step, baseline[step].Round(time.Millisecond))
			continue
		}
		t.Logf("%-20s healthy %8v  in recovery %8v  (limit %v)", step, baseline[step].Round(time.Millisecond), took.Round(time.Millisecond), limit)
		if took > limit {
			t.Errorf("%s of a file volume took %v while %s was in error recovery: %v with it healthy, limit %v", step, took.Round(time.Millisecond), disk.Path, baseline[step].Round(time.Millisecond), limit)
		}
	}
	t.Logf("after the file volume's calls: %s; the unstage still waits in its open: %v", after, stillHeld)
	if !stillHeld || !stillRecovering {
		t.Fatalf("the recovery ended during the file volume's calls (%s; the unstage waits in its open: %v): they were not measured against it", after, stillHeld)
	}

	select {
	case r := <-unstaged:
		t.Logf("NodeUnstageVolume of the iSCSI volume during the recovery: %v after %v", r.err, r.took.Round(time.Millisecond))
		if r.took > unstageDeadline+5*time.Second {
			t.Errorf("NodeUnstageVolume of the iSCSI volume ran %v, past its %v deadline", r.took, unstageDeadline)
		}
	case <-time.After(time.Minute):
		t.Errorf("NodeUnstageVolume of the iSCSI volume did not return a minute past its %v deadline", unstageDeadline)
	}
	select {
	case err := <-read:
		t.Logf("the read that started the recovery: %v", err)
	case <-time.After(2 * time.Minute):
		t.Fatalf("the read of %s did not end 2 min after the delay ended", disk.Path)
	}
	waitFor(t, 2*time.Minute, host+" to leave error recovery", func() bool { return sysAttr(host+"/state") != "recovery" })
	t.Logf("the delay ended: %s", states())
	for _, req := range []*csi.NodeUnstageVolumeRequest{stuck, other} {
		if err := retryRPC(90*time.Second, func(ctx context.Context) error {
			_, err := node.NodeUnstageVolume(ctx, req)
			return err
		}); err != nil {
			t.Fatalf("NodeUnstageVolume of %s after the recovery: %v", req.VolumeId, err)
		}
	}
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Errorf("%d sessions left after the unstages", n)
	}
	for _, name := range []string{dm.Name, disk.Name} {
		if _, err := os.Stat("/sys/class/block/" + name); err == nil {
			t.Errorf("%s still exists after the unstage", name)
		}
	}
	files.assertDetached(t)
}

// stageBlock stages LUN lun of target iqn as a raw block volume through
// a multipath map, unfenced, and unstages it when the test ends.
func stageBlock(t *testing.T, ctx context.Context, node csi.NodeClient, id, iqn, portal string, lun int, wwid string) *csi.NodeUnstageVolumeRequest {
	t.Helper()
	staging := filepath.Join(t.TempDir(), "staging")
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	vctx := map[string]string{"portals": fmt.Sprintf("[%q]", portal), "iqn": iqn, "lun": strconv.Itoa(lun), "wwid": wwid,
		"multipath": "true", agent.ContextFencing: "none"}
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: csitest.BlockCap(), VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume of %s: %v", id, err)
	}
	unstage := &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}
	t.Cleanup(func() {
		if err := retryRPC(90*time.Second, func(ctx context.Context) error {
			_, err := node.NodeUnstageVolume(ctx, unstage)
			return err
		}); err != nil {
			t.Errorf("NodeUnstageVolume of %s at cleanup: %v", id, err)
		}
	})
	return unstage
}

// targetLUNDisk returns the disk of LUN lun on the session to iqn.
func targetLUNDisk(t *testing.T, iqn string, lun int) *devices.Device {
	t.Helper()
	lctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := waitLUNDisk(lctx, iqn, lun)
	if err != nil {
		t.Fatal(err)
	}
	d, err := devices.Roots{}.Lookup(filepath.Base(p))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// sessionOf returns the sysfs directory of the iSCSI session of a disk.
func sessionOf(t *testing.T, disk *devices.Device) string {
	t.Helper()
	p, err := filepath.EvalSymlinks("/sys/block/" + disk.Name + "/device")
	if err != nil {
		t.Fatal(err)
	}
	for dir := p; dir != "/"; dir = filepath.Dir(dir) {
		if b := filepath.Base(dir); strings.HasPrefix(b, "session") {
			return "/sys/class/iscsi_session/" + b
		}
	}
	t.Fatalf("%s is not on an iSCSI session: %s", disk.Name, p)
	return ""
}

// fileSteps are the calls of a file volume's round, in order.
var fileSteps = []string{"NodeStageVolume", "NodePublishVolume", "write", "NodeUnpublishVolume", "NodeUnstageVolume"}

// fileVolumes runs file volumes (images in the file transport's root)
// through the agent, one round each.
type fileVolumes struct {
	node csi.NodeClient
	root string
	// unstaged are the images of the rounds that ended with their
	// unstage.
	unstaged []string
}

// fileRPCDeadline is each call's deadline in a round: far above what it
// takes, so that a call that waits is measured, not cut short.
const fileRPCDeadline = 30 * time.Second

// round stages a new 64 MiB image as ext4, publishes it, writes 1 MiB
// to it (and fsyncs), unpublishes and unstages it, and returns each
// step's time. The first failure ends the round.
func (f *fileVolumes) round(t *testing.T, name string) (map[string]time.Duration, error) {
	t.Helper()
	img := filepath.Join(f.root, name+".img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pod", "vol")
	for _, d := range []string{staging, filepath.Dir(target)} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	id := "vol-file-" + name
	vctx := map[string]string{file.KeyFile: filepath.Base(img)}
	capability := csitest.MountCap("ext4")
	t.Cleanup(func() {
		if err := retryRPC(time.Minute, func(ctx context.Context) error {
			if _, err := f.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
				return err
			}
			_, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}); err != nil {
			t.Errorf("file volume %s at cleanup: %v", id, err)
		}
	})
	payload := make([]byte, 1<<20)
	rand.Read(payload)
	calls := map[string]func(context.Context) error{
		"NodeStageVolume": func(ctx context.Context) error {
			_, err := f.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
				VolumeCapability: capability, VolumeContext: vctx})
			return err
		},
		"NodePublishVolume": func(ctx context.Context) error {
			_, err := f.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
				TargetPath: target, VolumeCapability: capability, VolumeContext: vctx})
			return err
		},
		"write": func(context.Context) error { return writeSynced(filepath.Join(target, "data"), string(payload)) },
		"NodeUnpublishVolume": func(ctx context.Context) error {
			_, err := f.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			return err
		},
		"NodeUnstageVolume": func(ctx context.Context) error {
			_, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		},
	}
	times := map[string]time.Duration{}
	for _, step := range fileSteps {
		cctx, cancel := context.WithTimeout(context.Background(), fileRPCDeadline)
		start := time.Now()
		err := calls[step](cctx)
		times[step] = time.Since(start)
		cancel()
		if err != nil {
			return times, fmt.Errorf("%s of %s: %w after %v", step, id, err, times[step].Round(time.Millisecond))
		}
	}
	f.unstaged = append(f.unstaged, img)
	return times, nil
}

// assertDetached fails the test if a loop device still shows the image
// of a round that ended with its unstage.
func (f *fileVolumes) assertDetached(t *testing.T) {
	t.Helper()
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, b := range loops {
		for _, img := range f.unstaged {
			if sysAttr(b) == img {
				t.Errorf("%s still shows %s after its unstage", filepath.Base(filepath.Dir(filepath.Dir(b))), img)
			}
		}
	}
}

// retryRPC calls call until it succeeds or d has passed, each call with
// what is left of d.
func retryRPC(d time.Duration, call func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		err := call(ctx)
		if err == nil || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// multipathMap finds the multipath map of a WWID.
func multipathMap(t *testing.T, wwid string) *devices.Device {
	t.Helper()
	names, _ := filepath.Glob("/sys/class/block/dm-*")
	for _, n := range names {
		d, err := devices.Roots{}.Lookup(filepath.Base(n))
		if err == nil && d.ID.Kind == devices.KindDM && devices.NormalizeWWID(d.ID.WWID) == wwid {
			return d
		}
	}
	t.Fatalf("no multipath map of %s", wwid)
	return nil
}

func sysAttr(p string) string {
	b, _ := os.ReadFile(p)
	return strings.TrimSpace(string(b))
}

// readDirect reads the first block of dev, bypassing the page cache, in
// the background: it reports when the read ends.
func readDirect(dev string) <-chan error {
	done := make(chan error, 1)
	go func() {
		fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
		if err != nil {
			done <- err
			return
		}
		defer unix.Close(fd)
		_, err = unix.Pread(fd, alignedBlock(4096), 0)
		done <- err
	}()
	return done
}

// goroutineInSyscall returns the stack of a goroutine of this process
// that is in a system call inside fn (a function as stacks name it), or
// "".
func goroutineInSyscall(fn string) string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		head, _, _ := bytes.Cut(g, []byte("\n"))
		if bytes.Contains(head, []byte("[syscall")) && bytes.Contains(g, []byte(fn)) {
			return string(g)
		}
	}
	return ""
}

// kernelStacks returns the kernel stacks of this process's threads that
// are in fn.
func kernelStacks(fn string) []string {
	var out []string
	tasks, _ := filepath.Glob("/proc/self/task/*/stack")
	for _, p := range tasks {
		if s := sysAttr(p); strings.Contains(s, fn) {
			out = append(out, s)
		}
	}
	return out
}

// delayMap is a dm-delay map over a loop device: a LUN's backing device
// whose I/O the test holds back.
type delayMap struct {
	name, path, loop string
	sectors          int64
}

func newDelayMap(t *testing.T, size int64) *delayMap {
	t.Helper()
	img := filepath.Join(t.TempDir(), "delay.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	out, err := execOutput("losetup", "-f", "--show", img)
	if err != nil {
		t.Fatal(err)
	}
	m := &delayMap{name: "berth-delay", loop: strings.TrimSpace(out), sectors: size / 512}
	m.path = "/dev/mapper/" + m.name
	if _, err := execOutput("dmsetup", "create", m.name, "--table", m.table(0)); err != nil {
		execOutput("losetup", "-d", m.loop)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := execOutput("dmsetup", "remove", "--retry", m.name); err != nil {
			t.Error(err)
		}
		execOutput("losetup", "-d", m.loop)
	})
	return m
}

// table is the map's table with every I/O delayed by d.
func (m *delayMap) table(d time.Duration) string {
	return fmt.Sprintf("0 %d delay %s 0 %d", m.sectors, m.loop, d.Milliseconds())
}

// Stall holds every I/O of the map back for d from now on (suspend,
// load, resume), and loads the table without a delay as the inactive one,
// for Unstall. udev's probe of the map after the resume waits for the
// delay too: dmsetup does not wait for udev.
func (m *delayMap) Stall(t *testing.T, d time.Duration) {
	t.Helper()
	for _, args := range [][]string{
		{"suspend", m.name},
		{"load", m.name, "--table", m.table(d)},
		{"resume", "--noudevsync", m.name},
		{"load", m.name, "--table", m.table(0)},
	} {
		if _, err := execOutput("dmsetup", args...); err != nil {
			t.Fatal(err)
		}
	}
}

// Unstall makes the table Stall loaded live. The map is suspended first,
// and dm-delay sends on every I/O it holds as it suspends. It is one
// ioctl (DM_DEV_SUSPEND without DM_SUSPEND_FLAG, as `dmsetup resume`),
// not a program: while an open that waits holds the fork lock (the
// failure this test is for), no program of this process starts.
func (m *delayMap) Unstall() error {
	ctl, err := os.OpenFile("/dev/mapper/control", os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer ctl.Close()
	var io unix.DmIoctl
	io.Version = [3]uint32{unix.DM_VERSION_MAJOR, 0, 0}
	io.Data_size = unix.SizeofDmIoctl
	io.Data_start = unix.SizeofDmIoctl
	copy(io.Name[:], m.name)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, ctl.Fd(), unix.DM_DEV_SUSPEND, uintptr(unsafe.Pointer(&io))); errno != 0 {
		return fmt.Errorf("resume %s (DM_DEV_SUSPEND): %w", m.name, errno)
	}
	return nil
}

func execOutput(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}
