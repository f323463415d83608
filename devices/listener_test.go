package devices

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

// The tests in this file drive a Listener without a socket: events are
// handed to dispatch as the receive loop would, on a fake sysfs tree.

func fakeListener(t *testing.T, roots Roots, udev bool) *Listener {
	l := newListener(listenerConfig{roots: roots, nodeMatches: anyNode}, udev)
	t.Cleanup(func() { l.Close() })
	return l
}

type waitResult struct {
	dev *Device
	err error
}

// startWait runs w.Wait in a goroutine and returns once the waiter has done
// its first sysfs scan (or already returned).
func startWait(t *testing.T, ctx context.Context, w *Waiter) <-chan waitResult {
	t.Helper()
	scanned := make(chan struct{})
	w.scanned = func() { close(scanned) }
	res := make(chan waitResult, 1)
	go func() {
		d, err := w.Wait(ctx)
		res <- waitResult{d, err}
	}()
	select {
	case <-scanned:
	case r := <-res:
		res <- r
	case <-time.After(10 * time.Second):
		t.Fatal("waiter did not scan")
	}
	return res
}

func expectPending(t *testing.T, res <-chan waitResult) {
	t.Helper()
	// Dispatch is synchronous up to the waiter's queue; give the waiting
	// goroutine a moment to (wrongly) return.
	select {
	case r := <-res:
		t.Fatalf("Wait returned early: %v %v", r.dev, r.err)
	case <-time.After(20 * time.Millisecond):
	}
}

func expectDevice(t *testing.T, res <-chan waitResult, name string) *Device {
	t.Helper()
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatalf("Wait: %v", r.err)
		}
		if r.dev == nil || r.dev.Name != name {
			t.Fatalf("Wait returned %v, want %s", r.dev, name)
		}
		return r.dev
	case <-time.After(10 * time.Second):
		t.Fatalf("Wait did not return %s", name)
	}
	return nil
}

// seq numbers the events of all tests, which run in parallel.
var seq atomic.Uint64

func blockEvent(src Source, action, devpath string, maj, min uint32) *Event {
	return &Event{
		Source: src, Action: action, DevPath: devpath, Subsystem: "block", DevType: "disk",
		Major: maj, Minor: min, HasDevNum: true, Seqnum: 1000 + seq.Add(1), Received: time.Now(),
	}
}

const loop1Path = "/devices/virtual/block/loop1"

// attachFake makes loop1 look attached to file in the fake tree.
func attachFake(sys *sysfstest.Tree, file string) {
	sys.File("devices/virtual/block/loop1/loop/backing_file", file+"\n")
	sys.File("devices/virtual/block/loop1/size", "2048\n")
}

func TestWaitFindsExistingDevice(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	w := l.Subscribe(MatchLoop("/var/lib/berth/volumes/pvc-1/disk.img"))
	defer w.Close()
	d, err := w.Wait(context.Background())
	if err != nil || d.Name != "loop0" {
		t.Fatalf("Wait = %v, %v", d, err)
	}
	if tr := w.Trace(); !tr.FromScan || tr.Found.Before(tr.Subscribed) {
		t.Errorf("trace %+v", tr)
	}
}

func TestWaitKernelEvent(t *testing.T) {
	t.Parallel()
	sys, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	const file = "/var/lib/berth/volumes/pvc-9/disk.img"
	w := l.Subscribe(MatchLoop(file))
	defer w.Close()
	res := startWait(t, context.Background(), w)

	// Events of other devices, other subsystems and partitions do not end the wait.
	l.dispatch(blockEvent(SourceKernel, "change", "/devices/virtual/block/loop0", 7, 0))
	l.dispatch(&Event{Source: SourceKernel, Action: "add", DevPath: "/devices/virtual/bdi/7:1", Subsystem: "bdi"})
	attachFake(sys, file)
	part := blockEvent(SourceKernel, "add", loop1Path, 7, 1)
	part.DevType = "partition"
	l.dispatch(part)
	expectPending(t, res)

	ev := blockEvent(SourceKernel, "change", loop1Path, 7, 1)
	l.dispatch(ev)
	d := expectDevice(t, res, "loop1")
	if d.ID.BackingFile != file || d.Size != 2048*512 {
		t.Errorf("device %+v", d)
	}
	tr := w.Trace()
	if tr.FromScan || tr.KernelEvent.Seqnum != ev.Seqnum || tr.UdevEvent.Seqnum != 0 {
		t.Errorf("trace %+v, want found by kernel event %d", tr, ev.Seqnum)
	}
}

func TestWaitUdev(t *testing.T) {
	t.Parallel()
	sys, roots := fakeSys(t)
	l := fakeListener(t, roots, true)
	if !l.Udev() {
		t.Fatal("udev mode off")
	}
	// loop0 exists and udev's database has it: found by the scan.
	writeFile(t, roots.UdevRun, "data/b7:0", "I:123\n")
	w0 := l.Subscribe(MatchLoop("/var/lib/berth/volumes/pvc-1/disk.img"))
	defer w0.Close()
	if d, err := w0.Wait(context.Background()); err != nil || d.Name != "loop0" {
		t.Fatalf("loop0: %v %v", d, err)
	}

	// loop1 gets attached: the kernel event arrives, udev still runs rules.
	const file = "/var/lib/berth/volumes/pvc-9/disk.img"
	writeFile(t, roots.UdevRun, "data/b7:1", "I:456\n") // from loop1's earlier "add"
	w := l.Subscribe(MatchLoop(file))
	defer w.Close()
	attachFake(sys, file)
	kev := blockEvent(SourceKernel, "change", loop1Path, 7, 1)
	l.dispatch(kev)
	res := startWait(t, context.Background(), w)
	expectPending(t, res)

	// Another waiter that starts now must not take the database entry as
	// proof either: the kernel event is newer than udev's last word.
	w2 := l.Subscribe(MatchLoop(file))
	defer w2.Close()
	res2 := startWait(t, context.Background(), w2)
	expectPending(t, res2)

	uev := blockEvent(SourceUdev, "change", loop1Path, 7, 1)
	uev.Seqnum = kev.Seqnum
	l.dispatch(uev)
	expectDevice(t, res, "loop1")
	expectDevice(t, res2, "loop1")
	tr := w.Trace()
	if tr.KernelEvent.Seqnum != kev.Seqnum || tr.UdevEvent.Seqnum != kev.Seqnum || tr.UdevEvent.Source != SourceUdev {
		t.Errorf("trace %+v", tr)
	}

	// Once udev is done, a later waiter finds it by the scan.
	w3 := l.Subscribe(MatchLoop(file))
	defer w3.Close()
	if d, err := w3.Wait(context.Background()); err != nil || d.Name != "loop1" || !w3.Trace().FromScan {
		t.Fatalf("after udev: %v %v", d, err)
	}
}

func TestWaitUdevNewDevice(t *testing.T) {
	t.Parallel()
	sys, roots := fakeSys(t)
	l := fakeListener(t, roots, true)
	const file = "/var/lib/berth/volumes/pvc-7/disk.img"
	w := l.Subscribe(MatchLoop(file))
	defer w.Close()
	attachFake(sys, file)
	// No database entry and no udev event yet: not ready, whatever the kernel says.
	res := startWait(t, context.Background(), w)
	l.dispatch(blockEvent(SourceKernel, "change", loop1Path, 7, 1))
	expectPending(t, res)
	l.dispatch(blockEvent(SourceUdev, "change", loop1Path, 7, 1))
	expectDevice(t, res, "loop1")
}

func TestWaitContextEnds(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	w := l.Subscribe(MatchNVMe("nqn.2014-08.org.berth:missing", 1, "", ""))
	defer w.Close()

	ctx, cancel := context.WithCancel(context.Background())
	res := startWait(t, ctx, w)
	cancel()
	r := <-res
	if !errors.Is(r.err, context.Canceled) || !strings.Contains(r.err.Error(), "NVMe namespace 1 of nqn.2014-08.org.berth:missing") {
		t.Errorf("cancelled: %v", r.err)
	}

	ctx, cancel = context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	w2 := l.Subscribe(MatchSCSI("9:0:0:1", "naa.600140500000000000000000000000ff"))
	defer w2.Close()
	_, err := w2.Wait(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "SCSI disk at 9:0:0:1") {
		t.Errorf("deadline: %v", err)
	}
}

func TestWaitOverflowRescans(t *testing.T) {
	t.Parallel()
	sys, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	const file = "/var/lib/berth/volumes/pvc-8/disk.img"
	w := l.Subscribe(MatchLoop(file))
	defer w.Close()
	res := startWait(t, context.Background(), w)
	// The device appears but its event is lost in a queue overflow.
	attachFake(sys, file)
	expectPending(t, res)
	l.overflow()
	expectDevice(t, res, "loop1")
}

func TestWaitListenerClosed(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	w := l.Subscribe(MatchLoop("/nonexistent"))
	defer w.Close()
	res := startWait(t, context.Background(), w)
	l.Close()
	if r := <-res; !errors.Is(r.err, ErrListenerClosed) {
		t.Errorf("Wait after Close: %v", r.err)
	}
}

func TestWaiterClosed(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	w := l.Subscribe(MatchLoop("/nonexistent"))
	w.Close()
	w.Close()
	l.dispatch(blockEvent(SourceKernel, "change", loop1Path, 7, 1))
	if len(w.queue) != 0 || len(l.subs) != 0 {
		t.Errorf("closed waiter still subscribed: queue %d subs %d", len(w.queue), len(l.subs))
	}
	if _, err := w.Wait(context.Background()); err == nil {
		t.Error("Wait on a closed waiter succeeded")
	}
}

func TestRemovalWaiter(t *testing.T) {
	t.Parallel()
	sys, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	d, err := roots.Lookup("sdc")
	if err != nil {
		t.Fatal(err)
	}
	w := l.subscribeRemoval(d)
	defer w.Close()
	res := startWait(t, context.Background(), w)
	l.dispatch(blockEvent(SourceKernel, "remove", "/devices/platform/host2/session1/target2:0:0/2:0:0:1/block/sdb", 8, 16))
	expectPending(t, res)
	// The kernel removes the sysfs directory before it sends "remove".
	sys.Remove("class/block/sdc")
	l.dispatch(blockEvent(SourceKernel, "remove", "/devices/platform/host3/session2/target3:0:0/3:0:0:1/block/sdc", 8, 32))
	select {
	case r := <-res:
		if r.err != nil || r.dev != nil {
			t.Fatalf("removal wait: %v %v", r.dev, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("removal not seen")
	}
	// Already gone: returns at once.
	w2 := l.subscribeRemoval(d)
	defer w2.Close()
	if _, err := w2.Wait(context.Background()); err != nil {
		t.Error(err)
	}
}

func TestFanOut(t *testing.T) {
	t.Parallel()
	sys, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	const n = 50
	results := make([]<-chan waitResult, n)
	for i := range n {
		w := l.Subscribe(MatchLoop(fmt.Sprintf("/vol/%d.img", i)))
		defer w.Close()
		results[i] = startWait(t, context.Background(), w)
	}
	for i := range n {
		name := fmt.Sprintf("loop%d", 100+i)
		dir := "devices/virtual/block/" + name
		sys.File(dir+"/dev", fmt.Sprintf("7:%d\n", 100+i))
		sys.File(dir+"/size", "8\n")
		sys.File(dir+"/loop/backing_file", fmt.Sprintf("/vol/%d.img\n", i))
		sys.Link("class/block/"+name, "../../"+dir)
		l.dispatch(blockEvent(SourceKernel, "add", "/"+dir, 7, uint32(100+i)))
	}
	for i := range n {
		expectDevice(t, results[i], fmt.Sprintf("loop%d", 100+i))
	}
}

func TestNotify(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	l := fakeListener(t, roots, false)
	var got []string
	stop := l.Notify(func(e EventInfo) { got = append(got, e.Action+" "+e.Name()) })
	l.dispatch(blockEvent(SourceKernel, "change", "/devices/virtual/block/dm-3", 253, 3))
	l.dispatch(&Event{Source: SourceKernel, Action: "add", Subsystem: "net", DevPath: "/devices/virtual/net/eth9"})
	l.dispatch(blockEvent(SourceKernel, "add", "/devices/platform/host5/target5:0:0/5:0:0:2/block/sdk", 8, 160))
	stop()
	l.dispatch(blockEvent(SourceKernel, "change", "/devices/virtual/block/dm-3", 253, 3))
	if want := []string{"change dm-3", "add sdk"}; !slices.Equal(got, want) {
		t.Errorf("Notify saw %q, want %q (block events only, none after stop)", got, want)
	}
}
