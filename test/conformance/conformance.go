// Package conformance is the contract of agent.Transport and agent.Target
// as one suite of tests, written once and run against every transport:
// the file transport on the host (loop devices), NVMe/TCP and iSCSI in
// their QEMU guests. A transport's test builds a Harness (the transport,
// and how to make, grow and break its storage) and calls Run:
//
//	func TestGuestConformance(t *testing.T) {
//		vm.RequireGuest(t)
//		conformance.Run(t, conformance.Harness{Transport: ..., NewVolume: ...})
//	}
//
// Each subtest makes storage of its own and leaves nothing attached. A
// subtest is skipped only where the harness declares the transport has
// no such thing (no second name of an object, no shared connection), and
// the skip says so.
package conformance

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Harness is what the suite needs of a transport and its storage.
type Harness struct {
	// Transport parses the volumes' contexts.
	Transport agent.Transport
	// NewVolume makes a fresh storage object of size bytes; the harness
	// removes it when the test ends (after the suite's detach).
	NewVolume func(t *testing.T, size int64) *Volume
	// NewSharedPair makes two storage objects of size bytes reached
	// through one connection (NVMe controller, iSCSI session); nil: the
	// transport shares none.
	NewSharedPair func(t *testing.T, size int64) (a, b *Volume)
	// Paths is the number of live paths (PathStates "live") an attached
	// volume has; 0: the transport has no paths, PathStates is nil, and
	// StopQueueing never reports a volume unreachable (its devices do
	// not queue I/O for a path to come back).
	Paths int
}

// Volume is one storage object made by a Harness.
type Volume struct {
	// Context and Secrets are the volume_context (with publish_context)
	// and secrets that name it.
	Context, Secrets map[string]string
	// Alias names the same object another way (a second portal or
	// address, a hard link); nil: the harness has no other name.
	Alias map[string]string
	// Grow enlarges the object to size bytes.
	Grow func(t *testing.T, size int64)
	// Vanish makes the object unreachable for good (its target or port
	// removed, its image deleted); nil: the harness cannot.
	Vanish func(t *testing.T)
}

const (
	size      = 32 << 20
	grownSize = 48 << 20
	// timeout bounds each subtest's calls.
	timeout = 90 * time.Second
	// goneWithin bounds how long the transport may take to notice that
	// its storage vanished.
	goneWithin = 30 * time.Second
)

// Run runs the suite's subtests against h.
func Run(t *testing.T, h Harness) {
	for _, tc := range []struct {
		name string
		fn   func(*testing.T, Harness)
	}{
		{"AttachDetachIdempotent", testAttachDetach},
		{"DetachBusy", testDetachBusy},
		{"Identity", testIdentity},
		{"Expand", testExpand},
		{"PathStates", testPathStates},
		{"HealthAfterVanish", testHealthAfterVanish},
		{"DetachVanished", testDetachVanished},
		{"SharedConnection", testSharedConnection},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, h) })
	}
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	return ctx
}

func parse(t *testing.T, h Harness, vc, secrets map[string]string) agent.Target {
	t.Helper()
	tg, err := h.Transport.Parse(vc, secrets)
	if err != nil {
		t.Fatalf("Parse(%v): %v", vc, err)
	}
	return tg
}

// attach attaches tg and detaches it when the test ends, whatever
// happened in between, so that nothing is left for the next subtest.
func attach(t *testing.T, ctx context.Context, tg agent.Target) *devices.Device {
	t.Helper()
	if err := tg.Preflight(ctx); err != nil {
		t.Fatalf("Preflight %s: %v", tg.Key(), err)
	}
	start := time.Now()
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatalf("Attach %s: %v", tg.Key(), err)
	}
	t.Logf("attached %s as %s in %v", tg.Key(), dev, time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if err := tg.Detach(ctx, nil); err != nil {
			t.Errorf("cleanup: Detach %s: %v", tg.Key(), err)
		}
	})
	return dev
}

func detach(t *testing.T, ctx context.Context, tg agent.Target, what string) {
	t.Helper()
	start := time.Now()
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatalf("%s: Detach %s: %v", what, tg.Key(), err)
	}
	t.Logf("%s: detached in %v", what, time.Since(start).Round(time.Millisecond))
}

// wantGone fails unless dev, the device an attach returned, is gone: its
// node, number or identity no longer verify.
func wantGone(t *testing.T, dev *devices.Device, what string) {
	t.Helper()
	d := *dev
	if err := d.Verify(); err == nil {
		t.Errorf("%s: device %s still there", what, dev)
	}
}

// wantIO writes a block to dev and reads it back.
func wantIO(t *testing.T, dev *devices.Device, what string) {
	t.Helper()
	f, err := os.OpenFile(dev.Path, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	defer f.Close()
	block := bytes.Repeat([]byte(what[:1]), 4096)
	if _, err := f.WriteAt(block, 8192); err != nil {
		t.Fatalf("%s: write %s: %v", what, dev.Path, err)
	}
	if err := f.Sync(); err != nil {
		t.Fatalf("%s: sync %s: %v", what, dev.Path, err)
	}
	got := make([]byte, len(block))
	if _, err := f.ReadAt(got, 8192); err != nil || !bytes.Equal(got, block) {
		t.Fatalf("%s: read back from %s: %v (equal: %v)", what, dev.Path, err, bytes.Equal(got, block))
	}
}

// testAttachDetach: a second Attach returns the same device; Detach
// removes it, and a second Detach is success.
func testAttachDetach(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	tg := parse(t, h, v.Context, v.Secrets)
	if again := parse(t, h, v.Context, v.Secrets); again.Key() != tg.Key() {
		t.Errorf("Key of one context: %q, then %q", tg.Key(), again.Key())
	}
	dev := attach(t, ctx, tg)
	dev2, err := tg.Attach(ctx)
	if err != nil {
		t.Fatalf("second Attach: %v", err)
	}
	if dev2.Major != dev.Major || dev2.Minor != dev.Minor || dev2.Path != dev.Path {
		t.Errorf("second Attach: %s, first %s", dev2, dev)
	}
	// A target parsed anew (as after a restart) finds the same device.
	dev3, err := parse(t, h, v.Context, v.Secrets).Attach(ctx)
	if err != nil {
		t.Fatalf("Attach of the context parsed again: %v", err)
	}
	if dev3.Major != dev.Major || dev3.Minor != dev.Minor {
		t.Errorf("Attach of the context parsed again: %s, first %s", dev3, dev)
	}
	if q, err := tg.StopQueueing(ctx); err != nil || q {
		t.Errorf("StopQueueing with the storage reachable: unreachable %v, %v", q, err)
	}
	if err := dev.Verify(); err != nil {
		t.Errorf("StopQueueing changed the device: %v", err)
	}
	detach(t, ctx, tg, "first")
	wantGone(t, dev, "after Detach")
	detach(t, ctx, tg, "second")
	// Unstage after a restart parses the stored context without secrets.
	detach(t, ctx, parse(t, h, v.Context, nil), "without secrets")
}

// testDetachBusy: Detach refuses (ErrBusy, naming the holder) while the
// device is held, here opened exclusively as a mount holds it, and the
// device keeps working; once let go, Detach removes it.
func testDetachBusy(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	tg := parse(t, h, v.Context, v.Secrets)
	dev := attach(t, ctx, tg)
	fd, err := unix.Open(dev.Path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open %s exclusively: %v", dev.Path, err)
	}
	held := true
	release := func() {
		if held {
			unix.Close(fd)
			held = false
		}
	}
	defer release()
	bctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err = tg.Detach(bctx, nil)
	t.Logf("Detach of a held device: %v", err)
	if !errors.Is(err, errdefs.ErrBusy) {
		t.Fatalf("Detach of a held device: %v, want ErrBusy", err)
	}
	if err := dev.Verify(); err != nil {
		t.Fatalf("device after the refused Detach: %v", err)
	}
	wantIO(t, dev, "after the refused Detach")
	if abnormal, msg := tg.Health(ctx); abnormal {
		t.Errorf("Health after the refused Detach: abnormal: %s", msg)
	}
	release()
	detach(t, ctx, tg, "let go")
	wantGone(t, dev, "after Detach")
}

// testIdentity: two names of one object have one identity, two objects
// two; the device attached is the object's (its size).
func testIdentity(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	w := h.NewVolume(t, size)
	tg := parse(t, h, v.Context, v.Secrets)
	id, err := tg.Identity()
	if err != nil || id == "" {
		t.Fatalf("Identity: %q, %v", id, err)
	}
	other := parse(t, h, w.Context, w.Secrets)
	if oid, err := other.Identity(); err != nil || oid == id {
		t.Errorf("Identity of another object: %q, %v; want one other than %q", oid, err, id)
	}
	if other.Key() == tg.Key() {
		t.Errorf("two objects have one key %q", tg.Key())
	}
	if v.Alias == nil {
		t.Logf("the harness gives no second name of an object: identity of aliases not checked")
	} else if aid, err := parse(t, h, v.Alias, v.Secrets).Identity(); err != nil || aid != id {
		t.Errorf("Identity of another name of the object: %q, %v; want %q", aid, err, id)
	}
	dev := attach(t, ctx, tg)
	if dev.Size != size {
		t.Errorf("device %s holds %d bytes, the object %d", dev, dev.Size, size)
	}
	if got, err := tg.Expand(ctx); err != nil || got != size {
		t.Errorf("Expand of an object that did not grow: %d, %v; want %d", got, err, size)
	}
	if aid, err := tg.Identity(); err != nil || aid != id {
		t.Errorf("Identity once attached: %q, %v; want %q", aid, err, id)
	}
	if err := dev.Verify(); err != nil {
		t.Errorf("device: %v", err)
	}
	wantIO(t, dev, "identity")
}

// testExpand: once the storage grew, ExpandTo returns at least the new
// size and Expand the new size.
func testExpand(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	tg := parse(t, h, v.Context, v.Secrets)
	dev := attach(t, ctx, tg)
	v.Grow(t, grownSize)
	start := time.Now()
	got, err := tg.ExpandTo(ctx, grownSize)
	if err != nil || got < grownSize {
		t.Fatalf("ExpandTo(%d) after the storage grew: %d, %v", grownSize, got, err)
	}
	t.Logf("ExpandTo: %d bytes in %v", got, time.Since(start).Round(time.Millisecond))
	if got, err := tg.Expand(ctx); err != nil || got != grownSize {
		t.Errorf("Expand: %d, %v; want %d", got, err, grownSize)
	}
	if err := dev.Verify(); err != nil {
		t.Fatalf("device after expand: %v", err)
	}
	if dev.Size != grownSize {
		t.Errorf("device %s holds %d bytes after expand, want %d", dev, dev.Size, grownSize)
	}
	// A second ExpandTo finds the size already there.
	if got, err := tg.ExpandTo(ctx, grownSize); err != nil || got != grownSize {
		t.Errorf("second ExpandTo: %d, %v; want %d", got, err, grownSize)
	}
}

// testPathStates: an attached volume has its live paths; a transport
// without paths answers nil.
func testPathStates(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	tg := parse(t, h, v.Context, v.Secrets)
	attach(t, ctx, tg)
	states, err := tg.PathStates(ctx)
	if err != nil {
		t.Fatalf("PathStates: %v", err)
	}
	t.Logf("path states: %v", states)
	if h.Paths == 0 {
		if states != nil {
			t.Errorf("PathStates of a transport without paths: %v, want nil", states)
		}
		return
	}
	total := 0
	for _, n := range states {
		total += n
	}
	if states["live"] != h.Paths || total != h.Paths {
		t.Errorf("PathStates: %v, want %d live and no other", states, h.Paths)
	}
}

// testHealthAfterVanish: Health is normal while the storage is there,
// and abnormal, with a message, once it vanished; StopQueueing then
// reports the volume unreachable, unless the transport has no paths.
func testHealthAfterVanish(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	if v.Vanish == nil {
		t.Skip("the harness cannot make the storage vanish")
	}
	tg := parse(t, h, v.Context, v.Secrets)
	attach(t, ctx, tg)
	if abnormal, msg := tg.Health(ctx); abnormal {
		t.Fatalf("Health while attached: abnormal: %s", msg)
	} else {
		t.Logf("health while attached: %q", msg)
	}
	v.Vanish(t)
	start := time.Now()
	abnormal, msg := tg.Health(ctx)
	for !abnormal && time.Since(start) < goneWithin {
		time.Sleep(100 * time.Millisecond)
		abnormal, msg = tg.Health(ctx)
	}
	if !abnormal {
		t.Fatalf("Health %v after the storage vanished: normal, %q", goneWithin, msg)
	}
	if msg == "" {
		t.Errorf("Health after the storage vanished: abnormal without a message")
	}
	t.Logf("health %v after the storage vanished: %q", time.Since(start).Round(time.Millisecond), msg)
	q, err := tg.StopQueueing(ctx)
	if err != nil {
		t.Errorf("StopQueueing after the storage vanished: %v", err)
	}
	if want := h.Paths > 0; q != want {
		t.Errorf("StopQueueing after the storage vanished: unreachable %v, want %v", q, want)
	}
}

// testDetachVanished: Detach of a volume whose storage vanished is
// success, and leaves no device.
func testDetachVanished(t *testing.T, h Harness) {
	ctx := testContext(t)
	v := h.NewVolume(t, size)
	if v.Vanish == nil {
		t.Skip("the harness cannot make the storage vanish")
	}
	tg := parse(t, h, v.Context, v.Secrets)
	dev := attach(t, ctx, tg)
	v.Vanish(t)
	if _, err := tg.StopQueueing(ctx); err != nil {
		t.Errorf("StopQueueing: %v", err)
	}
	detach(t, ctx, tg, "storage vanished")
	wantGone(t, dev, "after Detach")
	detach(t, ctx, tg, "again")
}

// testSharedConnection: detaching one of two volumes that share a
// connection leaves the other's device working.
func testSharedConnection(t *testing.T, h Harness) {
	if h.NewSharedPair == nil {
		t.Skipf("transport %s shares no connection between volumes", h.Transport.Name())
	}
	ctx := testContext(t)
	va, vb := h.NewSharedPair(t, size)
	a := parse(t, h, va.Context, va.Secrets)
	b := parse(t, h, vb.Context, vb.Secrets)
	da := attach(t, ctx, a)
	db := attach(t, ctx, b)
	if da.Major == db.Major && da.Minor == db.Minor {
		t.Fatalf("two objects attached as one device %s", da)
	}
	wantIO(t, da, "a before")
	detach(t, ctx, b, "b")
	// Whether b's device goes with it depends on the transport: an
	// iSCSI LUN is deleted from the session, an NVMe namespace stays
	// with its controller until the controller goes.
	if d := *db; d.Verify() == nil {
		t.Logf("b's device %s stays while the connection serves a", db)
	}
	if err := da.Verify(); err != nil {
		t.Fatalf("a after b's Detach: %v", err)
	}
	wantIO(t, da, "a after b's Detach")
	if abnormal, msg := a.Health(ctx); abnormal {
		t.Errorf("a's Health after b's Detach: abnormal: %s", msg)
	}
	if h.Paths > 0 {
		if states, err := a.PathStates(ctx); err != nil || states["live"] != h.Paths {
			t.Errorf("a's PathStates after b's Detach: %v, %v; want %d live", states, err, h.Paths)
		}
	}
	detach(t, ctx, a, "a")
	wantGone(t, da, "a after Detach")
}
