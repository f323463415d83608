package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
)

// newMapNode is a fencing node whose volume is a dm-multipath map over
// SCSI paths (the fake's "<device>-p<i>"), staged over one path.
func newMapNode(t *testing.T, id string, tgt *fakePRTarget, auth ...TakeoverAuthority) *fenceNode {
	t.Helper()
	f := newFenceNode(t, id, tgt, auth...)
	f.tr.kind = devices.KindDM
	lookup := f.a.lookup
	f.a.lookup = func(name string) (*devices.Device, error) {
		d, err := lookup(name)
		if err == nil {
			d.ID.Kind = devices.KindDM
		}
		return d, err
	}
	f.pr.npaths = 1
	return f
}

// nexus is the fake's name of path i of the node's staged device.
func (f *fenceNode) nexus(t *testing.T, i int) string {
	t.Helper()
	return fmt.Sprintf("%s/%s-p%d", f.id, f.record(t).Device.Name, i)
}

// A path that joins the map of a staged volume gets the node's key, and
// writes through it; a second look changes nothing at the target.
func TestNewPathRegistered(t *testing.T) {
	tgt := newFakePRTarget()
	a := newMapNode(t, "node-a", tgt)
	must(t, "stage on A", a.stage(snw, nil))
	ops := len(tgt.ops)
	a.a.registerNewPaths(context.Background())
	if len(tgt.ops) != ops {
		t.Errorf("a look right after the stage issued %q: the stage's paths are known", tgt.ops[ops:])
	}
	a.pr.npaths = 2
	if tgt.mayWrite(a.nexus(t, 1)) {
		t.Fatal("the fake lets an unregistered nexus write")
	}
	a.a.registerNewPaths(context.Background())
	if !a.registered(tgt) || tgt.holderKey() != NodeKey("node-a") || !tgt.mayWrite(a.nexus(t, 1)) {
		t.Fatalf("after the new path joined: A's keys %x, holder %#x, ops %q", tgt.keysOf("node-a"), tgt.holderKey(), tgt.ops)
	}
	gen, ops := tgt.gen, len(tgt.ops)
	a.a.registerNewPaths(context.Background())
	if tgt.gen != gen || len(tgt.ops) != ops {
		t.Errorf("a second look issued %q", tgt.ops[ops:])
	}
	// A berth that restarted knows no path: it finds them registered
	// (REGISTER conflicts) and changes nothing.
	a.a.paths = pathBook{}
	a.a.registerNewPaths(context.Background())
	if tgt.gen != gen || !a.registered(tgt) {
		t.Errorf("after a restart, a look changed the target: generation %d -> %d, ops %q", gen, tgt.gen, tgt.ops[ops:])
	}
	must(t, "unstage on A", a.unstage())
	if len(tgt.regs) != 0 || tgt.holderKey() != 0 {
		t.Fatalf("after the unstage: registrations %v", tgt.regs)
	}
}

// A path that joins the map of a node that another node preempted is
// not registered: the fenced node stays fenced.
func TestNewPathAfterPreempt(t *testing.T) {
	tgt := newFakePRTarget()
	a := newMapNode(t, "node-a", tgt)
	b := newMapNode(t, "node-b", tgt, &allow{allowed: true})
	must(t, "stage on A", a.stage(snw, nil))
	must(t, "B's takeover", b.stage(snw, nil))
	gen, ops := tgt.gen, len(tgt.ops)
	a.pr.npaths = 2
	for range 2 {
		a.a.registerNewPaths(context.Background())
	}
	if len(tgt.keysOf("node-a")) != 0 || tgt.gen != gen || tgt.mayWrite(a.nexus(t, 1)) {
		t.Fatalf("the preempted node registered its new path: A's keys %x, ops %q", tgt.keysOf("node-a"), tgt.ops[ops:])
	}
	if len(tgt.ops) != ops {
		t.Errorf("the preempted node issued %q", tgt.ops[ops:])
	}
	if c := a.condition(t); !c.Abnormal || !strings.Contains(c.Message, "preempted") {
		t.Errorf("A's condition: %+v", c)
	}
	// A refused path is not looked at again: each look takes the
	// volume's lock and reads the target, and block uevents come often
	// on a node whose paths fail, so the CO's calls on the volume
	// (NodeGetVolumeStats, NodeUnstageVolume) would be refused as busy
	// at random.
	reads := tgt.reads
	for range 3 {
		a.a.registerNewPaths(context.Background())
	}
	if tgt.reads != reads {
		t.Errorf("the preempted node looked at its refused path again: %d more reads of the reservation", tgt.reads-reads)
	}
}

// A preempt that lands between the check and the REGISTER of the new
// path: the registration is found alone and removed at once, and no
// further path is registered.
func TestNewPathPreemptRace(t *testing.T) {
	tgt := newFakePRTarget()
	a := newMapNode(t, "node-a", tgt)
	b := newMapNode(t, "node-b", tgt, &allow{allowed: true})
	must(t, "stage on A", a.stage(snw, nil))
	a.pr.npaths = 3
	tgt.beforeRegister = func() { must(t, "B's takeover", b.stage(snw, nil)) }
	ops := len(tgt.ops)
	a.a.registerNewPaths(context.Background())
	if len(tgt.keysOf("node-a")) != 0 || tgt.holderKey() != NodeKey("node-b") || !b.registered(tgt) {
		t.Fatalf("after the race: A's keys %x, holder %#x, ops %q", tgt.keysOf("node-a"), tgt.holderKey(), tgt.ops[ops:])
	}
	var mine []string
	for _, op := range tgt.ops[ops:] {
		if strings.Contains(op, " node-a/") {
			mine = append(mine, op)
		}
	}
	keyA := NodeKey("node-a")
	want := []string{
		fmt.Sprintf("register %s 0x0->%#x", a.nexus(t, 1), keyA),
		fmt.Sprintf("register %s %#x->0x0", a.nexus(t, 1), keyA),
	}
	if !slices.Equal(mine, want) {
		t.Errorf("A issued %q, want %q", mine, want)
	}
	if c := a.condition(t); !c.Abnormal || !strings.Contains(c.Message, "preempted") {
		t.Errorf("A's condition: %+v", c)
	}
}

// A multi-node volume (registrants, no reservation) gets its new path
// registered too, and not once another node reserved it exclusively.
func TestNewPathRegistrant(t *testing.T) {
	tgt := newFakePRTarget()
	a := newMapNode(t, "node-a", tgt)
	b := newMapNode(t, "node-b", tgt)
	mnmw := blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	must(t, "stage on A", a.stageCap(mnmw, nil))
	must(t, "stage on B", b.stageCap(mnmw, nil))
	a.pr.npaths = 2
	a.a.registerNewPaths(context.Background())
	if !a.registered(tgt) || !b.registered(tgt) {
		t.Fatalf("A's keys %x, B's %x", tgt.keysOf("node-a"), tgt.keysOf("node-b"))
	}
	// Another node's exclusive reservation (by hand here): A's next new
	// path is left alone.
	tgt.holder, tgt.typ = b.nexus(t, 0), devices.PRWriteExclusiveRegOnly
	a.pr.npaths = 3
	a.a.registerNewPaths(context.Background())
	if ks := tgt.keysOf("node-a"); len(ks) != 2 {
		t.Fatalf("a new path registered beside another node's exclusive reservation: A's keys %x", ks)
	}
	// B removes A's registrations without reserving (a preempt where
	// no one holds the reservation) just before A registers a new
	// path: the reservation still looks free, and A's key is found only
	// on the new nexus, which is unregistered again.
	tgt.holder, tgt.typ = "", 0
	tgt.beforeRegister = func() {
		must(t, "B's preempt", tgt.preempt(b.nexus(t, 0), NodeKey("node-b"), NodeKey("node-a"), devices.PRWriteExclusiveRegOnly, true))
	}
	a.pr.npaths = 4
	a.a.paths.set("vol", nil) // paths 0 to 2 are new to the book too
	a.a.registerNewPaths(context.Background())
	if ks := tgt.keysOf("node-a"); len(ks) != 0 {
		t.Fatalf("after a preempt without a reservation raced a new path: A's keys %x, ops %q", ks, tgt.ops)
	}
}

// A read that fails once (a unit attention) is read again; a check
// after the REGISTER that cannot be read removes the registration, and
// the next look registers the path.
func TestNewPathUnreadable(t *testing.T) {
	tgt := newFakePRTarget()
	a := newMapNode(t, "node-a", tgt)
	must(t, "stage on A", a.stage(snw, nil))
	a.pr.npaths = 2
	tgt.readErrs = 1
	a.a.registerNewPaths(context.Background())
	if !a.registered(tgt) {
		t.Fatalf("a unit attention kept the new path from its registration: A's keys %x", tgt.keysOf("node-a"))
	}
	a.pr.npaths = 3
	tgt.beforeRegister = func() { tgt.readErrs = 2 }
	a.a.registerNewPaths(context.Background())
	if ks := tgt.keysOf("node-a"); len(ks) != 2 || tgt.mayWrite(a.nexus(t, 2)) {
		t.Fatalf("a registration that could not be checked was kept: A's keys %x, ops %q", ks, tgt.ops)
	}
	a.a.registerNewPaths(context.Background())
	if !a.registered(tgt) {
		t.Fatalf("the next look did not register the path: A's keys %x", tgt.keysOf("node-a"))
	}
}

// A map whose path logged in again holds the key on the nexus that is
// gone as well: the unstage removes every registration of the key,
// though the map sends each command down a path of its choice.
func TestNewPathUnstageAfterRelogin(t *testing.T) {
	tgt := newFakePRTarget()
	a := newMapNode(t, "node-a", tgt)
	a.pr.npaths, a.pr.dmRouting = 2, true
	must(t, "stage on A", a.stage(snw, nil))
	if !a.registered(tgt) || tgt.holderKey() != NodeKey("node-a") {
		t.Fatalf("after the stage: A's keys %x, holder %#x", tgt.keysOf("node-a"), tgt.holderKey())
	}
	// Path 1's session logged out and in again: its nexus is another
	// one, the old one keeps the key (and the reservation if it held
	// it), and the new one is registered by the next look.
	for _, p := range []int{0, 1} {
		gone := a.nexus(t, 1)
		tgt.mu.Lock()
		tgt.regs[gone+"#gone"] = tgt.regs[gone]
		delete(tgt.regs, gone)
		if tgt.holder == gone {
			tgt.holder = gone + "#gone"
		}
		tgt.mu.Unlock()
		a.a.paths = pathBook{}
		a.a.registerNewPaths(context.Background())
		if ks := tgt.keysOf("node-a"); len(ks) != 3 {
			t.Fatalf("round %d: after the new path's look: A's registrations %v", p, tgt.regs)
		}
		must(t, "unstage on A", a.unstage())
		if len(tgt.regs) != 0 || tgt.holderKey() != 0 {
			t.Fatalf("round %d: after the unstage: registrations %v, holder %q", p, tgt.regs, tgt.holder)
		}
		must(t, "stage on A again", a.stage(snw, nil))
	}
}
