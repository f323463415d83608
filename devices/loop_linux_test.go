package devices

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/testutil"
)

func newTestListener(t testing.TB, opts ...ListenerOption) *Listener {
	t.Helper()
	l, err := NewListener(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func testFile(t testing.TB, dir, name string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return p
}

// attachForTest attaches file and detaches it when the test ends.
func attachForTest(t testing.TB, ctx context.Context, l *Listener, file string) *Device {
	t.Helper()
	d, err := AttachLoop(ctx, l, file, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { detachForTest(t, d) })
	return d
}

func detachForTest(t testing.TB, d *Device) {
	l, err := NewListener()
	if err != nil {
		t.Errorf("cleanup: %v", err)
		return
	}
	defer l.Close()
	if err := DetachLoopContext(context.Background(), l, d); err != nil {
		t.Errorf("cleanup: %v", err)
	}
}

func testContext(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestListenerUdevDetection: a listener looks for udev's control socket
// below the Roots it is given, not below the host's /run/udev.
func TestListenerUdevDetection(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	t.Parallel()
	run := t.TempDir()
	if l := newTestListener(t, WithRoots(Roots{UdevRun: run})); l.Udev() || l.Roots().UdevRun != run {
		t.Fatalf("without %s/control: udev %v, roots %+v", run, l.Udev(), l.Roots())
	}
	writeFile(t, run, "control", "")
	if l := newTestListener(t, WithRoots(Roots{UdevRun: run})); !l.Udev() {
		t.Fatalf("with %s/control: udev off", run)
	}
}

func TestLoopAttachDetach(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	file := testFile(t, dir, "vol.img", 4<<20)
	// A symbolic link resolves to the same backing file.
	link := filepath.Join(dir, "link.img")
	if err := os.Symlink(file, link); err != nil {
		t.Fatal(err)
	}

	d := attachForTest(t, ctx, l, link)
	if d.ID.Kind != KindLoop || d.ID.BackingFile != file || d.Size != 4<<20 || !strings.HasPrefix(d.Name, "loop") {
		t.Fatalf("attached %+v", d)
	}
	if maj, min, err := statBlockNode(d.Path); err != nil || maj != d.Major || min != d.Minor {
		t.Fatalf("node %s: %d:%d %v", d.Path, maj, min, err)
	}
	if err := d.Verify(); err != nil {
		t.Fatal(err)
	}
	if ro, _ := readAttr(d.sysPath, "ro"); ro != "0" {
		t.Errorf("read-only = %q", ro)
	}
	// The kernel must not clear it when the last opener (the agent) goes.
	lf, err := os.Open(d.Path)
	if err != nil {
		t.Fatal(err)
	}
	info, err := unix.IoctlLoopGetStatus64(int(lf.Fd()))
	lf.Close()
	if err != nil || info.Flags&4 != 0 {
		t.Fatalf("loop flags %+v %v: autoclear set", info, err)
	}

	// Attaching again returns the same device.
	again, err := AttachLoop(ctx, l, file, false)
	if err != nil || again.Name != d.Name || again.ID != d.ID {
		t.Fatalf("second attach: %v %v, want %s", again, err, d)
	}
	if _, err := AttachLoop(ctx, l, file, true); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("attach read-only over read-write: %v, want ErrAlreadyExists", err)
	}
	if f, err := (Roots{}).FindLoop(file); err != nil || f.Name != d.Name {
		t.Errorf("FindLoop = %v %v", f, err)
	}

	// Growing the file and refreshing the capacity.
	if err := os.Truncate(file, 6<<20); err != nil {
		t.Fatal(err)
	}
	size, err := RefreshLoopCapacity(ctx, d)
	if err != nil || size != 6<<20 || d.Size != 6<<20 {
		t.Errorf("RefreshLoopCapacity = %d %v (dev size %d), want %d", size, err, d.Size, 6<<20)
	}

	// The capacity change makes udev probe the device again: a plain
	// DetachLoop could find it held for a moment.
	if err := DetachLoopContext(ctx, l, d); err != nil {
		t.Fatal(err)
	}
	if _, err := (Roots{}).FindLoop(file); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("FindLoop after detach: %v", err)
	}
	if err := DetachLoop(d); err != nil {
		t.Errorf("second detach: %v", err)
	}
	if err := d.Verify(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Verify after detach: %v", err)
	}
	if _, err := RefreshLoopCapacity(ctx, d); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("RefreshLoopCapacity after detach: %v", err)
	}
}

func TestLoopReadOnly(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	file := testFile(t, t.TempDir(), "ro.img", 1<<20)
	d, err := AttachLoop(ctx, l, file, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { detachForTest(t, d) })
	if ro, _ := readAttr(d.sysPath, "ro"); ro != "1" {
		t.Errorf("read-only = %q, want 1", ro)
	}
	if f, err := os.OpenFile(d.Path, os.O_WRONLY, 0); err == nil {
		_, werr := f.Write(make([]byte, 4096))
		f.Close()
		if werr == nil {
			t.Error("wrote to a read-only loop device")
		}
	}
}

func TestLoopAttachErrors(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	if _, err := AttachLoop(ctx, l, filepath.Join(dir, "missing"), false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := AttachLoop(ctx, l, dir, false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("directory: %v", err)
	}
	if _, err := AttachLoop(ctx, l, "", false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("empty: %v", err)
	}
	if _, err := AttachLoop(ctx, nil, "/x", false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("nil listener: %v", err)
	}
	// A cancelled context attaches nothing.
	file := testFile(t, dir, "c.img", 1<<20)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := AttachLoop(cctx, l, file, false); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	if d, err := (Roots{}).FindLoop(file); err == nil {
		DetachLoop(d)
		t.Errorf("cancelled attach left %s", d)
	}
	if err := DetachLoop(&Device{Name: "sda", ID: Identity{Kind: KindSCSI}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("DetachLoop(scsi): %v", err)
	}
}

// TestWaitersAroundAttach: a waiter that subscribed and scanned before the
// attach sees it by its event, one that starts after finds it in sysfs, and
// one whose context is cancelled returns an error naming the file.
func TestWaitersAroundAttach(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	file := testFile(t, t.TempDir(), "w.img", 1<<20)

	before := l.Subscribe(MatchLoop(file))
	defer before.Close()
	resBefore := startWait(t, ctx, before)

	cancelled := l.Subscribe(MatchLoop(file))
	defer cancelled.Close()
	cctx, cancel := context.WithCancel(ctx)
	resCancelled := startWait(t, cctx, cancelled)
	cancel()
	if r := <-resCancelled; !errors.Is(r.err, context.Canceled) || !strings.Contains(r.err.Error(), file) {
		t.Errorf("cancelled waiter: %v %v", r.dev, r.err)
	}

	d := attachForTest(t, ctx, l, file)
	got := expectDevice(t, resBefore, d.Name)
	// With udev the waiter is released by udev's copy of the event; the
	// kernel's own copy comes on another socket and may be read after it.
	tr := before.Trace()
	ev, from := tr.KernelEvent, "the kernel's"
	if l.Udev() {
		ev, from = tr.UdevEvent, "udev's"
	}
	if tr.FromScan || ev.Seqnum == 0 || ev.Action != "change" || tr.Found.Before(ev.Received) {
		t.Errorf("waiter before attach: trace %+v, want found by %s change event", tr, from)
	}
	if got.ID != d.ID || got.DiskSeq != d.DiskSeq {
		t.Errorf("waiter got %+v, attach returned %+v", got, d)
	}

	// With udev, a later event of the device (udev's own "change" after
	// the attach closed the device for writing) may still be in progress;
	// then the waiter finds it by udev's event instead of the scan.
	after := l.Subscribe(MatchLoop(file))
	defer after.Close()
	if d2, err := after.Wait(ctx); err != nil || d2.Name != d.Name || (!l.Udev() && !after.Trace().FromScan) {
		t.Errorf("waiter after attach: %v %v, trace %+v", d2, err, after.Trace())
	}
}

// TestManyConcurrentWaiters attaches 100 files at once while 100 waiters,
// subscribed before, wait for them.
func TestManyConcurrentWaiters(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	const n = 100
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	files := make([]string, n)
	waiters := make([]*Waiter, n)
	results := make([]<-chan waitResult, n)
	for i := range n {
		files[i] = testFile(t, dir, fmt.Sprintf("%03d.img", i), 1<<20)
		waiters[i] = l.Subscribe(MatchLoop(files[i]))
		defer waiters[i].Close()
	}
	for i := range n {
		results[i] = startWait(t, ctx, waiters[i])
	}
	attached := make([]*Device, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { attached[i], errs[i] = AttachLoop(ctx, l, files[i], false) })
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, d := range attached {
			if d != nil {
				detachForTest(t, d)
			}
		}
	})
	names := map[string]bool{}
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("attach %s: %v", files[i], errs[i])
		}
		d := expectDevice(t, results[i], attached[i].Name)
		if d.ID.BackingFile != files[i] {
			t.Errorf("waiter %d got %s backed by %s", i, d.Name, d.ID.BackingFile)
		}
		if names[d.Name] {
			t.Errorf("%s attached twice", d.Name)
		}
		names[d.Name] = true
	}
}

// TestVerifyDetectsSwappedBackingFile re-binds the same loop device to
// another file behind the Device's back.
func TestVerifyDetectsSwappedBackingFile(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	a := testFile(t, dir, "a.img", 1<<20)
	b := testFile(t, dir, "b.img", 1<<20)
	d, err := AttachLoop(ctx, l, a, false)
	if err != nil {
		t.Fatal(err)
	}
	// With udev, its probe may hold the device a moment: wait for the detach.
	if err := DetachLoopContext(ctx, l, d); err != nil {
		t.Fatal(err)
	}
	bf, err := os.OpenFile(b, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	if err := l.configureLoop(d.Name, bf, b, false); err != nil {
		t.Fatal(err)
	}
	swapped, err := Roots{}.Lookup(d.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { detachForTest(t, swapped) })

	err = d.Verify()
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), a) || !strings.Contains(err.Error(), b) {
		t.Fatalf("Verify after swap: %v; want ErrFailedPrecondition naming %s and %s", err, a, b)
	}
	t.Log(err)
	// DetachLoop with the stale Device leaves the other file's device alone.
	if err := DetachLoop(d); err != nil {
		t.Fatal(err)
	}
	if cur, err := (Roots{}).FindLoop(b); err != nil || cur.Name != d.Name {
		t.Errorf("DetachLoop of the stale device detached %s: %v", b, err)
	}
	// Same file again on the same name: the disk sequence number tells.
	if err := DetachLoopContext(ctx, l, swapped); err != nil {
		t.Fatal(err)
	}
	af, err := os.OpenFile(a, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer af.Close()
	if err := l.configureLoop(d.Name, af, a, false); err != nil {
		t.Fatal(err)
	}
	if again, err := (Roots{}).Lookup(d.Name); err == nil {
		t.Cleanup(func() { detachForTest(t, again) })
	}
	if err := d.Verify(); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "sequence") {
		t.Errorf("Verify after re-attach of the same file: %v", err)
	}
}

func TestDetachBusy(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	file := testFile(t, t.TempDir(), "busy.img", 1<<20)
	d, err := AttachLoop(ctx, l, file, false)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := os.Open(d.Path)
	if err != nil {
		t.Fatal(err)
	}
	if err := DetachLoop(d); !errors.Is(err, errdefs.ErrBusy) {
		t.Errorf("detach while open: %v, want ErrBusy", err)
	}
	holder.Close()
	// The kernel detached it at the last close.
	if err := DetachLoop(d); err != nil {
		t.Errorf("detach after close: %v", err)
	}
	if _, err := (Roots{}).FindLoop(file); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("still attached: %v", err)
	}

	// DetachLoopContext waits for a holder that lets go soon.
	d, err = AttachLoop(ctx, l, file, false)
	if err != nil {
		t.Fatal(err)
	}
	if holder, err = os.Open(d.Path); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(100 * time.Millisecond)
		holder.Close()
	}()
	if err := DetachLoopContext(ctx, l, d); err != nil {
		t.Errorf("DetachLoopContext with a short-lived holder: %v", err)
	}
	if _, err := (Roots{}).FindLoop(file); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("still attached: %v", err)
	}
}

// TestOverflowRescan fills the socket's receive queue while the receive
// loop is stalled, so the attach event is lost: the waiter must still
// find the device through the rescan that ENOBUFS triggers.
func TestOverflowRescan(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	stall := make(chan struct{})
	var once sync.Once
	stalled := make(chan struct{})
	hook := func(EventInfo) {
		once.Do(func() { close(stalled); <-stall })
	}
	l := newTestListener(t, WithReceiveBuffer(4096), WithEventHook(hook), WithUdev(false))
	helper := newTestListener(t)
	dir := t.TempDir()
	flood := attachForTest(t, ctx, helper, testFile(t, dir, "flood.img", 1<<20))
	file := testFile(t, dir, "x.img", 1<<20)

	w := l.Subscribe(MatchLoop(file))
	defer w.Close()
	res := startWait(t, ctx, w)
	// The first event stalls the receive loop; the rest overflow the queue.
	for range 200 {
		if err := os.WriteFile(filepath.Join(flood.sysPath, "uevent"), []byte("change"), 0o200); err != nil {
			t.Fatal(err)
		}
	}
	<-stalled
	bf, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	name, err := l.configureFreeLoop(ctx, bf, file, false)
	if err != nil {
		t.Fatal(err)
	}
	d, err := Roots{}.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { detachForTest(t, d) })
	close(stall)
	expectDevice(t, res, name)
	if l.overflows.Load() == 0 {
		t.Error("no overflow was seen; the test did not exercise the rescan")
	}
}

// TestLoopLegacyIoctls attaches through LOOP_SET_FD and LOOP_SET_STATUS64,
// the path taken on kernels without LOOP_CONFIGURE (before 5.8).
func TestLoopLegacyIoctls(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t, withoutLoopConfigure())
	dir := t.TempDir()
	for _, ro := range []bool{false, true} {
		file := testFile(t, dir, fmt.Sprintf("legacy-%v.img", ro), 2<<20)
		d, err := AttachLoop(ctx, l, file, ro)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { detachForTest(t, d) })
		if d.ID.BackingFile != file || d.Size != 2<<20 {
			t.Errorf("legacy attach: %+v", d)
		}
		if got, _ := readAttr(d.sysPath, "ro"); (got == "1") != ro {
			t.Errorf("read-only %q, want %v", got, ro)
		}
		lf, err := os.Open(d.Path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := unix.IoctlLoopGetStatus64(int(lf.Fd()))
		lf.Close()
		if err != nil || !strings.HasPrefix(loopMarker+file, unix.ByteSliceToString(info.File_name[:])) || !strings.HasPrefix(unix.ByteSliceToString(info.File_name[:]), loopMarker) {
			t.Errorf("status %q %v", unix.ByteSliceToString(info.File_name[:]), err)
		}
	}
}

// foreignLoop attaches file at offset with a size limit, as an operator's
// losetup -o would, and detaches it when the test ends.
func foreignLoop(t *testing.T, file string, offset, sizeLimit uint64) *Device {
	t.Helper()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	bf, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	var name string
	// Another process may take the free device first: ask again.
	for try := 0; ; try++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			t.Fatal(err)
		}
		name = fmt.Sprintf("loop%d", n)
		lf, err := Roots{}.openLoop(name)
		if err != nil {
			t.Fatal(err)
		}
		cfg := unix.LoopConfig{Fd: uint32(bf.Fd())}
		cfg.Info.Offset, cfg.Info.Sizelimit = offset, sizeLimit
		copy(cfg.Info.File_name[:63], file)
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		lf.Close()
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EBUSY) || try == 10 {
			t.Fatalf("LOOP_CONFIGURE %s: %v", name, err)
		}
	}
	d, err := Roots{}.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { detachForTest(t, d) })
	return d
}

// A loop device on the file at an offset or with a size limit shows other
// bytes than the file: AttachLoop refuses it, naming the device and what
// differs, instead of adopting it; FindLoop does not return it; the
// device stays as it was.
func TestAttachLoopRefusesForeignDevice(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	for _, tc := range []struct {
		name              string
		offset, sizeLimit uint64
		want              string
	}{
		{"offset", 1 << 20, 0, "offset 1048576"},
		{"sizelimit", 0, 2 << 20, "size limit 2097152"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testContext(t)
			l := newTestListener(t)
			file := testFile(t, t.TempDir(), "vol.img", 4<<20)
			foreign := foreignLoop(t, file, tc.offset, tc.sizeLimit)

			d, err := AttachLoop(ctx, l, file, false)
			if err == nil {
				t.Cleanup(func() {
					if d.Name != foreign.Name {
						detachForTest(t, d)
					}
				})
			}
			if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), foreign.Path) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("AttachLoop with %s on the file: %v, %v; want ErrFailedPrecondition naming %s and %q", foreign.Path, d, err, foreign.Path, tc.want)
			}
			t.Log(err)
			if got, err := (Roots{}).FindLoop(file); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("FindLoop = %v, %v; want ErrNotFound", got, err)
			}
			if err := foreign.Verify(); err != nil {
				t.Fatalf("the foreign device changed: %v", err)
			}
			st, err := loopStatusOf(t, foreign)
			if err != nil || st.Offset != tc.offset || st.Sizelimit != tc.sizeLimit {
				t.Fatalf("the foreign device's status: %+v %v", st, err)
			}
		})
	}
}

func loopStatusOf(t *testing.T, d *Device) (*unix.LoopInfo64, error) {
	t.Helper()
	f, err := os.Open(d.Path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return unix.IoctlLoopGetStatus64(int(f.Fd()))
}

// A hard link is another name of the same file: the loop device of one
// name is the loop device of the other, and a device on another file is
// not.
func TestFindLoopByInode(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	file := testFile(t, dir, "vol.img", 4<<20)
	other := testFile(t, dir, "other.img", 4<<20)
	link := filepath.Join(dir, "link.img")
	if err := os.Link(file, link); err != nil {
		t.Fatal(err)
	}
	d := attachForTest(t, ctx, l, file)
	attachForTest(t, ctx, l, other)
	got, err := Roots{}.FindLoop(link)
	if err != nil || got.Name != d.Name {
		t.Fatalf("FindLoop(hard link) = %v, %v; want %s", got, err, d.Name)
	}
	again, err := AttachLoop(ctx, l, link, false)
	if err != nil || again.Name != d.Name {
		t.Fatalf("AttachLoop(hard link) = %v, %v; want %s", again, err, d.Name)
	}
}

// Once the file is deleted its inode cannot be compared: FindDeletedLoop
// returns only a device berth attached (its marker), from offset 0 without
// a size limit, not an operator's device of the same file.
func TestFindDeletedLoopOnlyBerths(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	mine := testFile(t, dir, "mine.img", 4<<20)
	theirs := testFile(t, dir, "theirs.img", 4<<20)
	d := attachForTest(t, ctx, l, mine)
	all := []*Device{d, foreignLoop(t, mine, 1<<20, 0), foreignLoop(t, theirs, 0, 0)} // the last one as a plain losetup: no marker
	for _, f := range []string{mine, theirs} {
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
	}
	// The backing files' names changed: the cleanups above no longer
	// recognise the devices.
	t.Cleanup(func() {
		for _, d := range all {
			if cur, err := (Roots{}).Lookup(d.Name); err == nil && strings.HasPrefix(cur.ID.BackingFile, dir+"/") {
				detachForTest(t, cur)
			}
		}
	})
	if got, err := (Roots{}).FindDeletedLoop(mine); err != nil || got.Name != d.Name {
		t.Fatalf("FindDeletedLoop(%s) = %v, %v; want %s", mine, got, err, d.Name)
	}
	if got, err := (Roots{}).FindDeletedLoop(theirs); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("FindDeletedLoop(%s) = %v, %v; want ErrNotFound", theirs, got, err)
	}
}

// TestAttachLoopNotSerialised holds one attach between taking a free loop
// device and configuring it; an attach of another file meanwhile must not
// wait for it: the kernel serialises the two only on the same device.
func TestAttachLoopNotSerialised(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	dir := t.TempDir()
	first, second := testFile(t, dir, "first.img", 1<<20), testFile(t, dir, "second.img", 1<<20)
	held, release := make(chan string, 1), make(chan struct{})
	var taken atomic.Bool
	l := newTestListener(t, withBeforeConfigure(func(name string) {
		if taken.CompareAndSwap(false, true) {
			held <- name
			<-release
		}
	}))
	releaseOnce := sync.OnceFunc(func() { close(release) })
	defer releaseOnce()

	type result struct {
		d   *Device
		err error
	}
	firstDone := make(chan result, 1)
	go func() {
		d, err := AttachLoop(ctx, l, first, false)
		firstDone <- result{d, err}
	}()
	heldName := <-held
	secondDone := make(chan result, 1)
	go func() {
		d, err := AttachLoop(ctx, l, second, false)
		secondDone <- result{d, err}
	}()
	var r2 result
	select {
	case r2 = <-secondDone:
	case <-time.After(5 * time.Second):
		t.Errorf("the attach of %s waited 5s for the attach of %s, held before configuring %s", second, first, heldName)
		releaseOnce()
		r2 = <-secondDone
	}
	releaseOnce()
	r1 := <-firstDone
	for _, r := range []result{r1, r2} {
		if r.err != nil {
			t.Fatal(r.err)
		}
		t.Cleanup(func() { detachForTest(t, r.d) })
	}
	if r1.d.Name == r2.d.Name {
		t.Errorf("both files attached to %s", r1.d.Name)
	}
	if r1.d.ID.BackingFile != first || r2.d.ID.BackingFile != second {
		t.Errorf("backing files %s, %s; want %s, %s", r1.d.ID.BackingFile, r2.d.ID.BackingFile, first, second)
	}
}

// When every existing loop device is claimed by an attach of this process,
// claimFreeLoop adds a device instead of handing out a claimed one.
func TestClaimFreeLoopAddsDevice(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ents, err := os.ReadDir("/sys/class/block")
	if err != nil {
		t.Fatal(err)
	}
	var fake []int
	loopClaims.Lock()
	for _, e := range ents {
		if n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "loop")); err == nil && strings.HasPrefix(e.Name(), "loop") {
			if _, held := loopClaims.held[n]; !held {
				loopClaims.held[n] = struct{}{}
				fake = append(fake, n)
			}
		}
	}
	loopClaims.Unlock()
	defer func() {
		loopClaims.Lock()
		for _, n := range fake {
			delete(loopClaims.held, n)
		}
		loopClaims.Unlock()
	}()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	n, release, err := Roots{}.claimFreeLoop(ctl, false)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	defer func() {
		if err := unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_REMOVE, n); err != nil {
			t.Errorf("remove loop%d again: %v", n, err)
		}
	}()
	if slices.Contains(fake, n) {
		t.Fatalf("claimFreeLoop handed out loop%d, which another attach holds", n)
	}
	f, err := Roots{}.openLoop("loop" + strconv.Itoa(n))
	if err != nil {
		t.Fatalf("the new loop%d cannot be opened: %v", n, err)
	}
	f.Close()
}

// The loop devices that may be bound are read from /proc/partitions,
// which lists only devices with a capacity: whole loop devices are
// taken, their partitions and other disks are not.
func TestReadPartitionLoops(t *testing.T) {
	p := filepath.Join(t.TempDir(), "partitions")
	content := `major minor  #blocks  name

 254        0  268435456 vda
 254        1  268434432 vda1
   7        0      65536 loop0
 259        0      65536 loop0p1
   7       12    1048576 loop12
 259        1      65536 nvme0n1
   7      300       4096 loop300
`
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := readPartitionLoops(p)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"loop0", "loop12", "loop300"}; !slices.Equal(got, want) {
		t.Fatalf("readPartitionLoops = %q, want %q", got, want)
	}
	if _, err := readPartitionLoops(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("a missing list read without error")
	}
}

// A loop device of a file smaller than a sector has no capacity, so
// /proc/partitions does not list it: it is still found, and attaching the
// file again returns it instead of binding a second device.
func TestAttachLoopTinyFileFoundAgain(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	file := testFile(t, t.TempDir(), "tiny.img", 100)
	d := attachForTest(t, ctx, l, file)
	again, err := AttachLoop(ctx, l, file, false)
	if err != nil || again.Name != d.Name {
		t.Fatalf("AttachLoop again = %v, %v; want %s", again, err, d.Name)
	}
	if got, err := (Roots{}).FindLoop(file); err != nil || got.Name != d.Name {
		t.Fatalf("FindLoop = %v, %v; want %s", got, err, d.Name)
	}
}

// On the node's trees the bound loop devices come from /proc/partitions:
// a device bound to a file is among them, an unbound one is not. Other
// packages' tests bind and free loop devices at the same time, so the
// list is compared only while /proc/partitions stayed the same around
// the call.
func TestBoundLoopsFromPartitions(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	d := attachForTest(t, ctx, l, testFile(t, t.TempDir(), "vol.img", 4<<20))
	read := func() []string {
		t.Helper()
		names, err := readPartitionLoops(partitionsFile)
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	for try := 0; ; try++ {
		before := read()
		if !slices.Contains(before, d.Name) {
			t.Fatalf("%s is bound but not in %s: %q", d.Name, partitionsFile, before)
		}
		got, err := Roots{}.boundLoops(4 << 20)
		if err != nil {
			t.Fatalf("boundLoops: %v", err)
		}
		if after := read(); !slices.Equal(before, after) {
			if try == 50 {
				t.Fatalf("%s changed during each of %d calls", partitionsFile, try+1)
			}
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if !slices.Equal(got, before) {
			t.Fatalf("boundLoops = %q; want the list of %s, %q", got, partitionsFile, before)
		}
		break
	}
	free, err := Roots{}.FindLoop(d.ID.BackingFile)
	if err != nil || free.Name != d.Name {
		t.Fatalf("FindLoop = %v, %v", free, err)
	}
}

// LoopBackingFile opens the file a loop device shows whole, with the
// device's size, after the device's cache reached it: a byte written
// through the device is in the file. Another file under the name, a
// device at an offset, a deleted file and a device that is not a loop
// give no file.
func TestLoopBackingFile(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	file := testFile(t, dir, "vol.img", 8<<20)
	d := attachForTest(t, ctx, l, file)
	want := func(what string, d *Device, whole bool) *os.File {
		t.Helper()
		f, size, err := LoopBackingFile(d)
		if err != nil || (f != nil) != whole {
			t.Fatalf("%s: LoopBackingFile = %v, %v; want a file: %t", what, f, err, whole)
		}
		if f == nil {
			return nil
		}
		t.Cleanup(func() { f.Close() })
		if size != 8<<20 {
			t.Fatalf("%s: LoopBackingFile size %d, want the device's %d", what, size, 8<<20)
		}
		return f
	}
	want("a sparse file", d, true)

	// Through the device, buffered: the device's cache holds it until
	// LoopBackingFile writes it back.
	dev, err := os.OpenFile(d.Path, os.O_WRONLY, 0)
	mustOK(t, err)
	_, err = dev.WriteAt([]byte{1}, 5<<20+17)
	mustOK(t, err)
	f := want("a byte written through the device, not synced", d, true)
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, 5<<20+17); err != nil || b[0] != 1 {
		t.Fatalf("the byte written through the device reads %v, %v from the file", b, err)
	}
	mustOK(t, dev.Close())

	// Another (sparse) file under the name: not the device's file.
	mustOK(t, os.Rename(file, file+".moved"))
	testFile(t, dir, "vol.img", 8<<20)
	want("another file under the name", d, false)
	mustOK(t, os.Remove(file))
	mustOK(t, os.Rename(file+".moved", file))
	want("the device's file back under its name", d, true)

	// A device on the file at an offset is not the whole file.
	other := testFile(t, dir, "other.img", 8<<20)
	want("a device at an offset", foreignLoop(t, other, 1<<20, 0), false)

	// Deleted: the kernel names the file "<path> (deleted)".
	mustOK(t, os.Remove(file))
	gone, err := Roots{}.Lookup(d.Name)
	mustOK(t, err)
	want("a deleted file", gone, false)
	mustOK(t, DetachLoop(gone))
	want("not a loop device", &Device{Name: "sda", ID: Identity{Kind: KindSCSI}}, false)
}

func mustOK(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// A node whose device the kernel does not let open (a disk not yet
// added, or being deleted: ENXIO) is not the device yet, even though
// sysfs and /dev show it; a device that opens is.
func TestNodeMatchesOnlyOpenable(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	// SCSI disk major 8, a minor no disk on this host has: the node
	// exists, the disk does not.
	const major, minor = 8, 239
	if _, err := os.Stat(fmt.Sprintf("/sys/dev/block/%d:%d", major, minor)); err == nil {
		t.Skipf("this host has a disk %d:%d", major, minor)
	}
	node := filepath.Join("/dev", fmt.Sprintf("berth-test-%d", os.Getpid()))
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(major, minor))); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(node)
	if nodeMatches(&Device{Path: node, Major: major, Minor: minor}) {
		t.Errorf("a node whose disk does not exist (open: ENXIO) matched")
	}
	l := newTestListener(t)
	d := attachForTest(t, testContext(t), l, testFile(t, t.TempDir(), "img", 1<<20))
	if !nodeMatches(d) {
		t.Errorf("the node of the bound loop device %s did not match", d)
	}
}

// A file renamed after AttachLoop opened it and before the loop device is
// bound: the attach does not wait for a device backed by the old name
// (which never comes) until its context ends; it answers at once with an
// error wrapping errdefs.ErrFailedPrecondition and leaves nothing bound
// to the file.
func TestAttachLoopFileRenamedWhileAttaching(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	dir := t.TempDir()
	file := testFile(t, dir, "vol.img", 4<<20)
	moved := filepath.Join(dir, "moved.img")
	l := newTestListener(t, withBeforeConfigure(func(string) {
		if err := os.Rename(file, moved); err != nil {
			t.Error(err)
		}
	}))
	t.Cleanup(func() {
		if d, err := (Roots{}).FindLoop(moved); err == nil {
			detachForTest(t, d)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	d, err := AttachLoop(ctx, l, file, false)
	el := time.Since(start)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("AttachLoop of a file renamed meanwhile = %v, %v after %v; want ErrFailedPrecondition", d, err, el.Round(time.Millisecond))
	}
	if el > 2*time.Second {
		t.Errorf("AttachLoop waited %v", el.Round(time.Millisecond))
	}
	if got, err := (Roots{}).FindLoop(moved); err == nil {
		t.Errorf("%s left bound to the renamed file", got.Path)
	}
}

// FindLoopRef finds a loop device by what its attach returned (number,
// backing inode), whatever its file is called since, and nothing else: a
// reference whose inode or number differs finds nothing.
func TestFindLoopRef(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	file := testFile(t, dir, "vol.img", 4<<20)
	d := attachForTest(t, ctx, l, file)
	ref, ok := d.LoopRef()
	if !ok {
		t.Fatalf("AttachLoop returned %v without its backing inode", d)
	}
	moved := filepath.Join(dir, "moved.img")
	if err := os.Rename(file, moved); err != nil {
		t.Fatal(err)
	}
	got, err := l.Roots().FindLoopRef(ref)
	if err != nil || got.Name != d.Name || got.ID.BackingFile != moved {
		t.Fatalf("FindLoopRef(%+v) after a rename = %v, %v; want %s backed by %s", ref, got, err, d.Name, moved)
	}
	// d is read under the old name: the device is detached as found now.
	t.Cleanup(func() { detachForTest(t, got) })
	for _, bad := range []LoopRef{
		{Name: ref.Name, Major: ref.Major, Minor: ref.Minor, BackingDev: ref.BackingDev, BackingIno: ref.BackingIno + 1},
		{Name: ref.Name, Major: ref.Major, Minor: ref.Minor + 1, BackingDev: ref.BackingDev, BackingIno: ref.BackingIno},
	} {
		if got, err := l.Roots().FindLoopRef(bad); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("FindLoopRef(%+v) = %v, %v; want ErrNotFound", bad, got, err)
		}
	}
}

// A device whose backing inode is known is detached by that inode, not
// by the name the kernel showed when it was read: a file renamed since
// has its device detached all the same.
func TestDetachLoopAfterRename(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	file := testFile(t, dir, "vol.img", 4<<20)
	d, err := AttachLoop(ctx, l, file, false)
	if err != nil {
		t.Fatal(err)
	}
	moved := filepath.Join(dir, "moved.img")
	if err := os.Rename(file, moved); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cur, err := (Roots{}).FindLoop(moved); err == nil {
			detachForTest(t, cur)
		}
	})
	if err := DetachLoopContext(ctx, l, d); err != nil {
		t.Fatal(err)
	}
	if cur, err := (Roots{}).FindLoop(moved); err == nil {
		t.Fatalf("DetachLoop of %s (read as backed by %s) left %s bound to %s", d.Path, d.ID.BackingFile, cur.Path, moved)
	}
}

// MarkedLoops lists berth's loop devices, with the path berth named the
// file by and the file's numbers, and not a plain losetup of a file.
func TestMarkedLoops(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	dir := t.TempDir()
	mine := testFile(t, dir, "mine.img", 4<<20)
	theirs := testFile(t, dir, "theirs.img", 4<<20)
	d := attachForTest(t, ctx, l, mine)
	other := foreignLoop(t, theirs, 0, 0)
	loops, err := Roots{}.MarkedLoops()
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, m := range loops {
		switch m.Device.Name {
		case other.Name:
			t.Errorf("MarkedLoops lists %s, attached without berth's marker", other.Path)
		case d.Name:
			found = true
			if m.File != mine {
				t.Errorf("MarkedLoops: %s has file %q, want %q", d.Path, m.File, mine)
			}
			if _, ok := m.Device.LoopRef(); !ok {
				t.Errorf("MarkedLoops: %s without its backing file's numbers", d.Path)
			}
		}
	}
	if !found {
		t.Fatalf("MarkedLoops = %v: %s missing", loops, d.Path)
	}
}
