package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// fakePRTarget is one LUN's persistent-reservation state as an SPC-3
// target keeps it: a key per I_T nexus (a node's path), one holder.
// Several agents share it, each reaching it through its own nexuses.
type fakePRTarget struct {
	mu      sync.Mutex
	regs    map[string]uint64 // nexus -> key
	holder  string            // nexus, "" when not reserved
	typ     devices.PRType
	gen     uint32
	aborted []string // nexuses whose commands a preempt aborted
	// unsupported makes every command fail as a target without
	// reservations does.
	unsupported bool
	// beforeReserve, when set, runs before each Reserve (outside the
	// lock): a second node's stage slipping in.
	beforeReserve func()
	// beforeRegister, when set, runs before the next Register (outside
	// the lock): another node's preempt landing first.
	beforeRegister func()
	// readErrs fail the next reads as a unit attention does.
	readErrs int
	// reads counts the reservation reads.
	reads int
	ops   []string
	// nvme makes REGISTER behave as an NVMe target's (nvmet's): the
	// kernel sends a REGISTER from old key 0 as the Register action,
	// which a host registered already with that same key sees succeed,
	// the generation counting it; SCSI refuses it and changes nothing.
	nvme bool
}

func newFakePRTarget() *fakePRTarget { return &fakePRTarget{regs: make(map[string]uint64)} }

var errConflict = fmt.Errorf("fake: %w", devices.ErrReservationConflict)

func (t *fakePRTarget) check() error {
	if t.unsupported {
		return fmt.Errorf("fake: illegal request: %w", errdefs.ErrUnsupported)
	}
	return nil
}

func (t *fakePRTarget) register(nx string, old, new uint64, ignore bool) error {
	if f := t.beforeRegister; f != nil {
		t.beforeRegister = nil
		f()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.check(); err != nil {
		return err
	}
	t.ops = append(t.ops, fmt.Sprintf("register %s %#x->%#x", nx, old, new))
	cur, ok := t.regs[nx]
	if t.nvme && ok && old == 0 && !ignore {
		if cur != new {
			return errConflict
		}
		t.gen++
		return nil
	}
	if !ignore {
		switch {
		case !ok && old != 0:
			return errConflict
		case ok && old != cur:
			return errConflict
		}
	}
	switch {
	case new == 0 && ok:
		delete(t.regs, nx)
		if t.holder == nx {
			t.holder, t.typ = "", 0
		}
	case new != 0:
		t.regs[nx] = new
	}
	t.gen++
	return nil
}

func (t *fakePRTarget) reserve(nx string, key uint64, typ devices.PRType) error {
	if f := t.beforeReserve; f != nil {
		t.beforeReserve = nil
		f()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.check(); err != nil {
		return err
	}
	t.ops = append(t.ops, fmt.Sprintf("reserve %s %#x", nx, key))
	if k, ok := t.regs[nx]; !ok || k != key {
		return errConflict
	}
	if t.holder != "" {
		if t.holder == nx && t.typ == typ {
			return nil
		}
		return errConflict
	}
	t.holder, t.typ = nx, typ
	return nil
}

func (t *fakePRTarget) release(nx string, key uint64, typ devices.PRType) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ops = append(t.ops, fmt.Sprintf("release %s %#x", nx, key))
	if k, ok := t.regs[nx]; !ok || k != key {
		return errConflict
	}
	if t.holder == nx {
		if t.typ != typ {
			return errors.New("fake: invalid release of another type")
		}
		t.holder, t.typ = "", 0
	}
	return nil
}

func (t *fakePRTarget) preempt(nx string, key, victim uint64, typ devices.PRType, abort bool) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ops = append(t.ops, fmt.Sprintf("preempt %s %#x victim %#x abort %t", nx, key, victim, abort))
	if k, ok := t.regs[nx]; !ok || k != key {
		return errConflict
	}
	holderKey := t.regs[t.holder]
	found := false
	for n, k := range t.regs {
		if k != victim {
			continue
		}
		found = true
		// The issuing nexus keeps its registration (SPC-4 5.14.11.5.4):
		// a node preempting its own key removes its other nexuses'.
		if n == nx {
			continue
		}
		delete(t.regs, n)
		if abort {
			t.aborted = append(t.aborted, n)
		}
	}
	if !found {
		return errConflict
	}
	if t.holder != "" && holderKey == victim {
		t.holder, t.typ = nx, typ
	}
	t.gen++
	return nil
}

func (t *fakePRTarget) read() (devices.Reservation, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.reads++
	if err := t.check(); err != nil {
		return devices.Reservation{}, err
	}
	if t.readErrs > 0 {
		t.readErrs--
		return devices.Reservation{}, errdefs.Unavailable("fake: unit attention")
	}
	nexuses := make([]string, 0, len(t.regs))
	for n := range t.regs {
		nexuses = append(nexuses, n)
	}
	sort.Strings(nexuses)
	r := devices.Reservation{Generation: t.gen}
	for _, n := range nexuses {
		r.Keys = append(r.Keys, t.regs[n])
	}
	if t.holder != "" {
		r.Holder, r.Type = t.regs[t.holder], t.typ
	}
	return r, nil
}

// mayWrite reports whether the target accepts a write from nexus nx
// under the reservation (Write Exclusive – Registrants Only: registrants
// only).
func (t *fakePRTarget) mayWrite(nx string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, reg := t.regs[nx]
	return t.holder == "" || reg
}

func (t *fakePRTarget) holderKey() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.holder == "" {
		return 0
	}
	return t.regs[t.holder]
}

func (t *fakePRTarget) keysOf(node string) []uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var ks []uint64
	for n, k := range t.regs {
		if strings.HasPrefix(n, node+"/") {
			ks = append(ks, k)
		}
	}
	return ks
}

// fakePRHost is one node's view of a fakePRTarget: the device's paths
// are nexuses "<node>/<device>-p<i>"; commands through the whole device
// go through its first path, as dm-multipath sends them through one.
// Once the sessions logged in again (session > 0) the nexuses are others:
// "<node>/<device>-p<i>#<session>".
type fakePRHost struct {
	t       *fakePRTarget
	node    string
	npaths  int
	opens   int
	nvme    bool // the reports name this host's registration
	session int
	// dmRouting sends the commands through the whole device as
	// dm-multipath does (fakeMapDev), not all through the first path.
	dmRouting bool
	next      int
}

// fakeMapDev is a dm-multipath map's reservation commands: a REGISTER
// goes down every path in turn and stops at the first that fails; every
// other command goes down one path, the next one each time (the path
// selector's choice).
type fakeMapDev struct {
	h    *fakePRHost
	name string
}

func (m *fakeMapDev) path(i int) string { return fmt.Sprintf("%s/%s-p%d", m.h.node, m.name, i) }

func (m *fakeMapDev) current() string {
	m.h.next++
	return m.path(m.h.next % m.h.npaths)
}

func (m *fakeMapDev) Register(old, new uint64, ignore bool) error {
	for i := range m.h.npaths {
		if err := m.h.t.register(m.path(i), old, new, ignore); err != nil {
			return err
		}
	}
	return nil
}
func (m *fakeMapDev) Reserve(k uint64, typ devices.PRType) error {
	return m.h.t.reserve(m.current(), k, typ)
}
func (m *fakeMapDev) Release(k uint64, typ devices.PRType) error {
	return m.h.t.release(m.current(), k, typ)
}
func (m *fakeMapDev) Preempt(k, v uint64, typ devices.PRType, abort bool) error {
	return m.h.t.preempt(m.current(), k, v, typ, abort)
}
func (m *fakeMapDev) ReadReservation() (devices.Reservation, error) { return m.h.t.read() }
func (m *fakeMapDev) Close() error                                  { return nil }

func (h *fakePRHost) paths(d *devices.Device) ([]*devices.Device, error) {
	var ps []*devices.Device
	for i := range h.npaths {
		p := *d
		p.Name = fmt.Sprintf("%s-p%d", d.Name, i)
		if d.ID.Kind == devices.KindDM {
			p.ID.Kind = devices.KindSCSI // a map's paths are disks
		}
		ps = append(ps, &p)
	}
	return ps, nil
}

func (h *fakePRHost) open(d *devices.Device) (prDevice, error) {
	h.opens++
	if h.dmRouting && !strings.Contains(d.Name, "-p") {
		return &fakeMapDev{h: h, name: d.Name}, nil
	}
	nx := h.node + "/" + d.Name
	if !strings.Contains(d.Name, "-p") {
		nx += "-p0"
	}
	if h.session > 0 {
		nx += fmt.Sprintf("#%d", h.session)
	}
	return &fakePRDev{t: h.t, nx: nx, nvme: h.nvme}, nil
}

type fakePRDev struct {
	t    *fakePRTarget
	nx   string
	nvme bool
}

func (d *fakePRDev) Register(old, new uint64, ignore bool) error {
	return d.t.register(d.nx, old, new, ignore)
}
func (d *fakePRDev) Reserve(k uint64, typ devices.PRType) error { return d.t.reserve(d.nx, k, typ) }
func (d *fakePRDev) Release(k uint64, typ devices.PRType) error { return d.t.release(d.nx, k, typ) }
func (d *fakePRDev) Preempt(k, v uint64, typ devices.PRType, abort bool) error {
	return d.t.preempt(d.nx, k, v, typ, abort)
}
func (d *fakePRDev) ReadReservation() (devices.Reservation, error) {
	r, err := d.t.read()
	if err == nil && d.nvme {
		// NVMe tells registrants apart by host: the report says which
		// is this one's.
		d.t.mu.Lock()
		r.OwnKnown = true
		r.OwnKey, r.OwnRegistered = d.t.regs[d.nx]
		d.t.mu.Unlock()
	}
	return r, err
}
func (d *fakePRDev) Close() error { return nil }

// fenceNode is one node of a fencing test: an agent on fakes whose
// devices are SCSI disks with two paths to a shared target.
type fenceNode struct {
	id      string
	a       *Agent
	n       *nodeServer
	tr      *fakeTransport
	host    *fakeFS
	pr      *fakePRHost
	staging string
}

func newFenceNode(t *testing.T, id string, tgt *fakePRTarget, auth ...TakeoverAuthority) *fenceNode {
	t.Helper()
	a, host, tr := newFakeAgent(t)
	a.cfg.NodeID = id
	a.cfg.Takeover = auth
	tr.kind = devices.KindSCSI
	lookup := a.lookup
	a.lookup = func(name string) (*devices.Device, error) {
		d, err := lookup(name)
		if err == nil {
			d.ID.Kind = devices.KindSCSI
		}
		return d, err
	}
	pr := &fakePRHost{t: tgt, node: id, npaths: 2}
	a.pr = pr
	staging := filepath.Join(t.TempDir(), "staging")
	must(t, "mkdir", mkdirAll(staging))
	return &fenceNode{id: id, a: a, n: &nodeServer{a: a}, tr: tr, host: host, pr: pr, staging: staging}
}

func (f *fenceNode) stage(mode csi.VolumeCapability_AccessMode_Mode, vctx map[string]string) error {
	return f.stageCap(mountCap("ext4", mode), vctx)
}

func (f *fenceNode) stageCap(c *csi.VolumeCapability, vctx map[string]string) error {
	req := stageReq("vol", f.staging, "1")
	req.VolumeCapability = c
	for k, v := range vctx {
		req.VolumeContext[k] = v
	}
	_, err := f.n.NodeStageVolume(context.Background(), req)
	return err
}

func (f *fenceNode) unstage() error {
	_, err := f.n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: f.staging})
	return err
}

func (f *fenceNode) condition(t *testing.T) *csi.VolumeCondition {
	t.Helper()
	resp, err := f.n.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: "vol", VolumePath: f.staging})
	if err != nil {
		t.Fatalf("%s: NodeGetVolumeStats: %v", f.id, err)
	}
	return resp.GetVolumeCondition()
}

// registered reports whether every path of the node has its key.
func (f *fenceNode) registered(tgt *fakePRTarget) bool {
	ks := tgt.keysOf(f.id)
	return len(ks) == f.pr.npaths && !slices.ContainsFunc(ks, func(k uint64) bool { return k != NodeKey(f.id) })
}

func (f *fenceNode) record(t *testing.T) *volumeRecord {
	t.Helper()
	rec, ok, err := f.a.state.lookup("vol")
	if err != nil || !ok {
		t.Fatalf("%s: no record: %v", f.id, err)
	}
	return rec
}

// allow is a TakeoverAuthority with a fixed answer that counts its calls.
type allow struct {
	mu      sync.Mutex
	allowed bool
	node    string
	calls   []TakeoverRequest
	err     error
}

func (a *allow) AuthorizeTakeover(_ context.Context, req TakeoverRequest) (TakeoverDecision, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, req)
	if a.err != nil {
		return TakeoverDecision{}, a.err
	}
	return TakeoverDecision{Allowed: a.allowed, HolderNode: a.node, Reason: "test authority"}, nil
}

func wantFenceCode(t *testing.T, what string, err error, code codes.Code, contains ...string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("%s: %v, want %s", what, err, code)
	}
	for _, c := range contains {
		if !strings.Contains(err.Error(), c) {
			t.Errorf("%s: %q does not say %q", what, err, c)
		}
	}
}

func TestNodeKey(t *testing.T) {
	// Computed independently: 0xB3E7<<48 | sha256("berth-node:node-a")[:6].
	for id, want := range map[string]uint64{"node-a": 0xb3e72e55d81a228c, "node-b": 0xb3e7db7f1a601499} {
		if got := NodeKey(id); got != want {
			t.Errorf("NodeKey(%q) = %#x, want %#x", id, got, want)
		}
		if !IsBerthKey(NodeKey(id)) {
			t.Errorf("IsBerthKey(NodeKey(%q)) false", id)
		}
	}
	if IsBerthKey(0x1234) || IsBerthKey(0) {
		t.Error("foreign key taken for berth's")
	}
}

// The whole single-writer life on two nodes: A takes the reservation; B
// is refused and A is untouched; B with authorisation preempts A (with
// abort) and A's writes are refused at the target; A reports it, a
// repeated stage on A is refused, A's unstage leaves B alone; B moves the
// volume back by unstaging, and A stages without preempting.
func TestFenceTwoNodes(t *testing.T) {
	tgt := newFakePRTarget()
	authB := &allow{}
	a := newFenceNode(t, "node-a", tgt)
	b := newFenceNode(t, "node-b", tgt, authB)
	keyA, keyB := NodeKey("node-a"), NodeKey("node-b")

	must(t, "stage on A", a.stage(snw, nil))
	if tgt.holderKey() != keyA || !a.registered(tgt) || tgt.typ != devices.PRWriteExclusiveRegOnly {
		t.Fatalf("after A's stage: holder %#x, A's keys %x, type %d", tgt.holderKey(), tgt.keysOf("node-a"), tgt.typ)
	}
	if r := a.record(t); r.Fence == nil || r.Fence.Key != keyA || r.Fence.Mode != fenceReserve {
		t.Fatalf("A's record: fence %+v", r.Fence)
	}
	gen := tgt.gen
	must(t, "repeated stage on A", a.stage(snw, nil))
	if tgt.gen != gen || tgt.holderKey() != keyA {
		t.Fatalf("a repeated stage changed the reservation: gen %d->%d", gen, tgt.gen)
	}

	err := b.stage(snw, nil)
	wantFenceCode(t, "B's stage without authorisation", err, codes.FailedPrecondition, fmt.Sprintf("%#016x", keyA))
	if len(tgt.keysOf("node-b")) != 0 || tgt.holderKey() != keyA || !a.registered(tgt) {
		t.Fatalf("the refused stage changed the target: B's keys %x, holder %#x", tgt.keysOf("node-b"), tgt.holderKey())
	}
	if b.tr.detached["1"] != 1 {
		t.Fatalf("the refused stage left the device attached (detached %d)", b.tr.detached["1"])
	}
	if _, ok, _ := b.a.state.lookup("vol"); ok {
		t.Fatal("the refused stage left a record")
	}
	if len(authB.calls) != 1 || authB.calls[0].Holder != keyA || authB.calls[0].NodeID != "node-b" || authB.calls[0].VolumeID != "vol" {
		t.Fatalf("authority asked %+v", authB.calls)
	}

	authB.allowed, authB.node = true, "node-a"
	start := time.Now()
	must(t, "B's authorised stage", b.stage(snw, nil))
	t.Logf("takeover stage in %v", time.Since(start))
	if tgt.holderKey() != keyB || !b.registered(tgt) || len(tgt.keysOf("node-a")) != 0 {
		t.Fatalf("after the takeover: holder %#x, A's keys %x, B's %x", tgt.holderKey(), tgt.keysOf("node-a"), tgt.keysOf("node-b"))
	}
	if len(tgt.aborted) != 2 || !strings.HasPrefix(tgt.aborted[0], "node-a/") {
		t.Fatalf("aborted %v, want A's two nexuses", tgt.aborted)
	}
	if tgt.mayWrite("node-a/fake250-1-p0") || tgt.mayWrite("node-a/fake250-1-p1") || !tgt.mayWrite("node-b/fake250-1-p1") {
		t.Fatal("the target lets the fenced node write, or not the new holder")
	}

	c := a.condition(t)
	if !c.Abnormal || !strings.Contains(c.Message, "preempted") || !strings.Contains(c.Message, fmt.Sprintf("%#016x", keyB)) {
		t.Fatalf("A's condition after the takeover: %+v", c)
	}
	if c := b.condition(t); c.Abnormal {
		t.Fatalf("B's condition: %+v", c)
	}
	// The metrics and berth volumes read the condition too.
	if vs := a.a.Volumes(context.Background()); len(vs) != 1 || !vs[0].Abnormal || !strings.Contains(vs[0].Message, "preempted") {
		t.Fatalf("A's Volumes: %+v", vs)
	}
	if msg := (&Agent{lookup: a.a.lookup}).preempted(a.record(t)); msg != "" {
		t.Fatalf("an agent without reservation commands says %q", msg)
	}
	wantFenceCode(t, "repeated stage on the preempted A", a.stage(snw, nil), codes.FailedPrecondition, "preempted")
	if len(tgt.keysOf("node-a")) != 0 {
		t.Fatal("the preempted node registered again")
	}

	ops := len(tgt.ops)
	// Its buffers cannot be written any more: the flush fails, which
	// does not hold up the unstage of a preempted node.
	a.host.flushErr = errors.New("fake: EIO")
	must(t, "unstage on the preempted A", a.unstage())
	must(t, "unstage on A again", a.unstage())
	if tgt.holderKey() != keyB || !b.registered(tgt) {
		t.Fatal("A's unstage touched B's reservation")
	}
	for _, op := range tgt.ops[ops:] {
		if !strings.Contains(op, fmt.Sprintf("%#x", keyA)) {
			t.Errorf("A's unstage issued %q, which is not about its own key", op)
		}
	}

	b.host.flushErr = errors.New("fake: EIO")
	if err := b.unstage(); err == nil {
		t.Fatal("a failed flush of the holder's device was ignored")
	}
	b.host.flushErr = nil
	must(t, "unstage on B", b.unstage())
	if tgt.holderKey() != 0 || len(tgt.regs) != 0 {
		t.Fatalf("after B's unstage: holder %#x, registrations %v", tgt.holderKey(), tgt.regs)
	}
	calls := len(authB.calls)
	must(t, "stage back on A", a.stage(snw, nil))
	if tgt.holderKey() != keyA || len(tgt.aborted) != 2 || len(authB.calls) != calls {
		t.Fatalf("the graceful move back: holder %#x, aborted %v", tgt.holderKey(), tgt.aborted)
	}
}

// A refused stage and the fenced node's condition name the holder's node
// where berth can list it (Config.HolderName: the Kubernetes API's
// Nodes), and otherwise its key, as the berth key of an unknown node.
func TestFenceNamesHolder(t *testing.T) {
	listed := func(nodes ...string) func(uint64) string {
		return func(k uint64) string {
			for _, n := range nodes {
				if NodeKey(n) == k {
					return n
				}
			}
			return ""
		}
	}
	keyA, keyB := fmt.Sprintf("%#016x", NodeKey("node-a")), fmt.Sprintf("%#016x", NodeKey("node-b"))
	tgt := newFakePRTarget()
	auth := &allow{}
	a := newFenceNode(t, "node-a", tgt)
	b := newFenceNode(t, "node-b", tgt, auth)
	must(t, "stage on A", a.stage(snw, nil))

	wantFenceCode(t, "B, no node list", b.stage(snw, nil), codes.FailedPrecondition, "held at the target by key "+keyA+" (the berth key of an unknown node)")
	b.a.cfg.HolderName = listed("node-c")
	wantFenceCode(t, "B, a list without A", b.stage(snw, nil), codes.FailedPrecondition, "key "+keyA+" (the berth key of an unknown node)")
	b.a.cfg.HolderName = listed("node-a", "node-b")
	wantFenceCode(t, "B, a list with A", b.stage(snw, nil), codes.FailedPrecondition, `held at the target by node "node-a" (key `+keyA+")")
	auth.node = "node-z" // an authority's word comes first
	wantFenceCode(t, "B, the authority names it", b.stage(snw, nil), codes.FailedPrecondition, `node "node-z"`)

	auth.allowed, auth.node = true, ""
	must(t, "B's authorised stage", b.stage(snw, nil))
	for _, c := range []struct {
		names func(uint64) string
		want  string
	}{
		{nil, "preempted by key " + keyB + " (the berth key of an unknown node)"},
		{listed("node-a"), "preempted by key " + keyB + " (the berth key of an unknown node)"},
		{listed("node-a", "node-b"), `preempted by node "node-b" (key ` + keyB + "): this node's writes fail at the target"},
	} {
		a.a.cfg.HolderName = c.names
		if got := a.condition(t); !got.Abnormal || !strings.Contains(got.Message, c.want) {
			t.Errorf("A's condition %+v, want %q", got, c.want)
		}
	}
	wantFenceCode(t, "repeated stage on the preempted A", a.stage(snw, nil), codes.FailedPrecondition, `preempted by node "node-b"`)
}

// A stage whose authority answers with an error, or that has none, fails
// closed, and leaves nothing registered.
func TestFenceFailsClosed(t *testing.T) {
	for name, auth := range map[string][]TakeoverAuthority{
		"none":  nil,
		"error": {&allow{err: errors.New("the API server is unreachable")}},
		"no":    {&allow{}, &allow{}},
	} {
		t.Run(name, func(t *testing.T) {
			tgt := newFakePRTarget()
			a := newFenceNode(t, "node-a", tgt)
			b := newFenceNode(t, "node-b", tgt, auth...)
			must(t, "stage on A", a.stage(snw, nil))
			// No authority knows the holder's node: it is named by its key.
			wantFenceCode(t, "stage on B", b.stage(snw, nil), codes.FailedPrecondition, fmt.Sprintf("%#016x", NodeKey("node-a")))
			if len(tgt.keysOf("node-b")) != 0 || tgt.holderKey() != NodeKey("node-a") {
				t.Fatalf("B left keys %x, holder %#x", tgt.keysOf("node-b"), tgt.holderKey())
			}
		})
	}
}

// Two stages that race: exactly one holds the device, the other is
// refused and unregistered, whichever step of the winner comes between
// the loser's.
func TestFenceRace(t *testing.T) {
	t.Run("both read it free", func(t *testing.T) {
		tgt := newFakePRTarget()
		a := newFenceNode(t, "node-a", tgt)
		b := newFenceNode(t, "node-b", tgt)
		// B has read the device free and registered; A, which read
		// it free too, registers and reserves before B reserves.
		tgt.beforeReserve = func() {
			for _, nx := range []string{"node-a/fake250-1-p0", "node-a/fake250-1-p1"} {
				must(t, "A registers", tgt.register(nx, 0, NodeKey("node-a"), false))
			}
			must(t, "A reserves", tgt.reserve("node-a/fake250-1-p0", NodeKey("node-a"), fenceType))
		}
		wantFenceCode(t, "the losing stage", b.stage(snw, nil), codes.FailedPrecondition, "at the same time", fmt.Sprintf("%#016x", NodeKey("node-a")))
		if tgt.holderKey() != NodeKey("node-a") || !a.registered(tgt) || len(tgt.keysOf("node-b")) != 0 {
			t.Fatalf("after the race: holder %#x, A %x, B %x", tgt.holderKey(), tgt.keysOf("node-a"), tgt.keysOf("node-b"))
		}
	})
	t.Run("one reads the other's registration", func(t *testing.T) {
		tgt := newFakePRTarget()
		a := newFenceNode(t, "node-a", tgt)
		b := newFenceNode(t, "node-b", tgt)
		// B has registered; A's whole stage runs before B reserves:
		// A finds B registered and is refused, B then holds.
		tgt.beforeReserve = func() {
			wantFenceCode(t, "A's stage", a.stage(snw, nil), codes.FailedPrecondition, fmt.Sprintf("%#016x", NodeKey("node-b")))
		}
		must(t, "B's stage", b.stage(snw, nil))
		if tgt.holderKey() != NodeKey("node-b") || !b.registered(tgt) || len(tgt.keysOf("node-a")) != 0 {
			t.Fatalf("after the race: holder %#x, A %x, B %x", tgt.holderKey(), tgt.keysOf("node-a"), tgt.keysOf("node-b"))
		}
	})
}

// A key berth did not make, holding or only registered, is named and
// left alone.
func TestFenceForeignKey(t *testing.T) {
	tgt := newFakePRTarget()
	tgt.regs["operator/x"] = 0x1234
	tgt.holder, tgt.typ = "operator/x", devices.PRWriteExclusive
	auth := &allow{allowed: true}
	a := newFenceNode(t, "node-a", tgt, auth)
	wantFenceCode(t, "stage beside a foreign key", a.stage(snw, nil), codes.FailedPrecondition, "0x0000000000001234", "not a berth key")
	if len(tgt.regs) != 1 || tgt.holderKey() != 0x1234 || len(auth.calls) != 0 || len(tgt.ops) != 0 {
		t.Fatalf("the foreign key was touched: %v, ops %v, asked %d", tgt.regs, tgt.ops, len(auth.calls))
	}
}

// A crash between register and reserve leaves the node's key registered
// and no holder; the retry converges on a reservation. A crash between
// preempt and the record leaves the node holding without having
// recorded it; the retry records it and asks no authority again.
func TestFenceCrashConverges(t *testing.T) {
	t.Run("register-reserve", func(t *testing.T) {
		tgt := newFakePRTarget()
		a := newFenceNode(t, "node-a", tgt)
		tgt.regs["node-a/fake250-1-p0"] = NodeKey("node-a")
		must(t, "stage after the crash", a.stage(snw, nil))
		if tgt.holderKey() != NodeKey("node-a") || !a.registered(tgt) {
			t.Fatalf("holder %#x, keys %x", tgt.holderKey(), tgt.keysOf("node-a"))
		}
	})
	t.Run("preempt-record", func(t *testing.T) {
		tgt := newFakePRTarget()
		auth := &allow{}
		b := newFenceNode(t, "node-b", tgt, auth)
		tgt.regs["node-b/fake250-1-p0"] = NodeKey("node-b")
		tgt.holder, tgt.typ = "node-b/fake250-1-p0", devices.PRWriteExclusiveRegOnly
		must(t, "stage after the crash", b.stage(snw, nil))
		if tgt.holderKey() != NodeKey("node-b") || !b.registered(tgt) || len(auth.calls) != 0 {
			t.Fatalf("holder %#x, keys %x, asked %d", tgt.holderKey(), tgt.keysOf("node-b"), len(auth.calls))
		}
		if r := b.record(t); r.Fence == nil || r.Fence.Key != NodeKey("node-b") {
			t.Fatalf("fence not recorded: %+v", r.Fence)
		}
	})
	t.Run("refused-after-crash", func(t *testing.T) {
		// B crashed between register and reserve while A held: its
		// retry is refused and unregisters the key it left.
		tgt := newFakePRTarget()
		a := newFenceNode(t, "node-a", tgt)
		b := newFenceNode(t, "node-b", tgt)
		must(t, "stage on A", a.stage(snw, nil))
		tgt.regs["node-b/fake250-1-p0"] = NodeKey("node-b")
		wantFenceCode(t, "B's retry", b.stage(snw, nil), codes.FailedPrecondition)
		if len(tgt.keysOf("node-b")) != 0 || tgt.holderKey() != NodeKey("node-a") {
			t.Fatalf("B's keys %x, holder %#x", tgt.keysOf("node-b"), tgt.holderKey())
		}
	})
}

// A stage that fails after the fence (here: the mount) gives the
// reservation back with its undo.
func TestFenceUndoneByFailedStage(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	a.host.mountErr = errors.New("mount failed")
	if err := a.stage(snw, nil); err == nil {
		t.Fatal("stage succeeded")
	}
	if len(tgt.regs) != 0 || tgt.holderKey() != 0 {
		t.Fatalf("the failed stage left %v, holder %#x", tgt.regs, tgt.holderKey())
	}
}

// Multi-node modes: multi-writer registers only, readers do nothing, and
// a multi-writer stage does not join another node's exclusive volume.
func TestFenceMultiNode(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	b := newFenceNode(t, "node-b", tgt)
	mnmw := blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	must(t, "multi-writer A", a.stageCap(mnmw, nil))
	must(t, "multi-writer B", b.stageCap(mnmw, nil))
	if tgt.holderKey() != 0 || !a.registered(tgt) || !b.registered(tgt) {
		t.Fatalf("multi-writer: holder %#x regs %v", tgt.holderKey(), tgt.regs)
	}
	must(t, "unstage A", a.unstage())
	must(t, "unstage B", b.unstage())
	if len(tgt.regs) != 0 {
		t.Fatalf("left %v", tgt.regs)
	}

	r := newFenceNode(t, "node-r", tgt)
	must(t, "stage on A", a.stage(snw, nil))
	must(t, "reader beside the writer", r.stage(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, nil))
	if r.pr.opens != 0 || r.record(t).Fence != nil {
		t.Fatal("a reader touched the reservation")
	}
	wantFenceCode(t, "multi-writer beside an exclusive holder", b.stageCap(mnmw, nil), codes.FailedPrecondition, "exclusive")
	if len(tgt.keysOf("node-b")) != 0 {
		t.Fatal("registered beside an exclusive holder")
	}
}

// A target without reservations refuses the single-writer stage unless
// the volume opts out, and an opted-out volume says it is unfenced. A bad
// value changes nothing.
func TestFenceUnsupportedAndOptOut(t *testing.T) {
	tgt := newFakePRTarget()
	tgt.unsupported = true
	a := newFenceNode(t, "node-a", tgt)
	wantFenceCode(t, "stage on a target without reservations", a.stage(snw, nil), codes.FailedPrecondition, `fencing: "none"`)
	if _, ok, _ := a.a.state.lookup("vol"); ok || a.tr.attached["1"] != a.tr.detached["1"] {
		t.Fatal("the refused stage left work behind")
	}
	wantFenceCode(t, "bad fencing value", a.stage(snw, map[string]string{"fencing": "off"}), codes.InvalidArgument, "fencing")
	if a.tr.attached["1"] != 1 {
		t.Fatal("a bad value attached")
	}
	must(t, "opted out", a.stage(snw, map[string]string{"fencing": "none"}))
	if c := a.condition(t); c.Abnormal || !strings.Contains(c.Message, "unfenced") {
		t.Fatalf("condition %+v", c)
	}
	if vs := a.a.Volumes(context.Background()); len(vs) != 1 || !vs[0].Unfenced {
		t.Fatalf("Volumes: %+v, want the volume unfenced (the metric)", vs)
	}
	wantFenceCode(t, "restage asking for fencing", a.stage(snw, nil), codes.AlreadyExists)
	must(t, "unstage", a.unstage())
}

// An unfenced volume's condition names why, for each way to be unfenced,
// and Volumes (the metric) counts it; a fenced volume, and one fencing
// does not apply to, are not unfenced.
func TestUnfencedCondition(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	must(t, "stage", a.stage(snw, nil))
	check := func(what, want string) {
		t.Helper()
		c := a.condition(t)
		vs := a.a.Volumes(context.Background())
		if len(vs) != 1 {
			t.Fatalf("%s: Volumes %+v", what, vs)
		}
		switch {
		case c.Abnormal:
			t.Errorf("%s: abnormal: %+v", what, c)
		case want == "" && (vs[0].Unfenced || strings.Contains(c.Message, "unfenced")):
			t.Errorf("%s: unfenced: %+v, %q", what, vs[0], c.Message)
		case want != "" && (!vs[0].Unfenced || !strings.Contains(c.Message, "unfenced ("+want)):
			t.Errorf("%s: %q (unfenced %t), want it unfenced: %q", what, c.Message, vs[0].Unfenced, want)
		}
	}
	check("fenced", "")
	rec := a.record(t)
	for _, c := range []struct {
		what  string
		fence *fenceRecord
		mode  string
		want  string
	}{
		{"opted out", &fenceRecord{Mode: fenceNone}, snw.String(), `opted out with volume_context fencing: "none"`},
		{"target without reservations", &fenceRecord{Mode: fenceUnavailable}, snw.String(), "the target has no persistent reservations"},
		{"staged by a berth that did not fence", nil, snw.String(), "staged by a berth that did not fence"},
		{"a multi-node writer staged by a berth that did not fence", nil, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER.String(), "staged by a berth that did not fence"},
		{"a reader", nil, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY.String(), ""},
	} {
		rec.Fence, rec.Mode = c.fence, c.mode
		must(t, "record", a.a.state.put(rec))
		check(c.what, c.want)
	}
	if why := (&volumeRecord{Staged: true, Mode: snw.String(), Device: &deviceRecord{Kind: devices.KindLoop}}).unfencedReason(); why != "" {
		t.Errorf("a node-local device: unfenced (%s)", why)
	}
}

// berth restarted on the holder: the repeated stage (a raw block one,
// which goes through the fence again) changes nothing at the target, and
// the unstage after the restart gives the reservation back.
func TestFenceRestart(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	c := blockCap(snw)
	must(t, "stage", a.stageCap(c, nil))
	st, err := openStore(filepath.Join(a.a.cfg.StateDir, "volumes"))
	must(t, "reopen state", err)
	a.a.state = st
	a.a.locks = newInflight()
	gen := tgt.gen
	must(t, "stage after the restart", a.stageCap(c, nil))
	if tgt.gen != gen || tgt.holderKey() != NodeKey("node-a") || !a.registered(tgt) {
		t.Fatalf("the repeated stage changed the target: generation %d -> %d, ops %v", gen, tgt.gen, tgt.ops)
	}
	// A path that appeared since (a new session) is registered.
	a.pr.npaths = 3
	must(t, "stage with a new path", a.stageCap(c, nil))
	if !a.registered(tgt) {
		t.Fatalf("the new path is not registered: %x", tgt.keysOf("node-a"))
	}
	must(t, "unstage", a.unstage())
	if len(tgt.regs) != 0 {
		t.Fatalf("left %v", tgt.regs)
	}
}

// A record v0.1.0 wrote again (in a rollback, v0.1.0's publish of a
// raw block volume today's berth staged) is in format 1 and has lost the
// fence, which v0.1.0 does not know. v0.1.0 never fenced, so the node's
// key on the device of a format 1 record is one a later berth
// registered: the unstage gives it back. v0.1.0's own volumes, never
// fenced, are unstaged as before, on a target with reservations or
// without.
func TestFenceLostByV010Rewrite(t *testing.T) {
	t.Run("fenced", func(t *testing.T) {
		tgt := newFakePRTarget()
		a := newFenceNode(t, "node-a", tgt)
		must(t, "stage", a.stage(snw, nil))
		a.rewriteAsV010(t)
		must(t, "unstage", a.unstage())
		if len(tgt.regs) != 0 || tgt.holderKey() != 0 {
			t.Fatalf("left at the target: keys %v, holder %#x", tgt.regs, tgt.holderKey())
		}
	})
	t.Run("never fenced", func(t *testing.T) {
		tgt := newFakePRTarget()
		a := newFenceNode(t, "node-a", tgt)
		must(t, "stage", a.stage(snw, map[string]string{"fencing": "none"}))
		a.rewriteAsV010(t)
		must(t, "unstage", a.unstage())
		if len(tgt.ops) != 0 {
			t.Fatalf("the unstage of a volume never fenced changed the target: %v", tgt.ops)
		}
	})
	t.Run("no reservations", func(t *testing.T) {
		tgt := newFakePRTarget()
		tgt.unsupported = true
		a := newFenceNode(t, "node-a", tgt)
		must(t, "stage", a.stage(snw, map[string]string{"fencing": "none"}))
		a.rewriteAsV010(t)
		must(t, "unstage on a target without reservations", a.unstage())
	})
}

// A nexus of the node that is gone keeps its key and the reservation:
// the session of a login before a reboot, or of an unstage by v0.1.0,
// which knows no fencing; open-iscsi gives a new session a new ISID, a
// new I_T nexus. The stage after it registers the new paths, whose
// release is no release (SPC: the holder is the nexus that reserved);
// the unstage removes the old nexus's key and reservation too.
func TestFenceStaleNexus(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	must(t, "stage", a.stage(snw, nil))
	must(t, "unstage by hand", a.unstage())
	// The node's key and reservation through sessions that are gone.
	key := NodeKey("node-a")
	tgt.regs["node-a/old-p0"], tgt.regs["node-a/old-p1"] = key, key
	tgt.holder, tgt.typ = "node-a/old-p0", fenceType
	must(t, "stage again", a.stage(snw, nil))
	must(t, "unstage", a.unstage())
	if len(tgt.regs) != 0 || tgt.holderKey() != 0 {
		t.Fatalf("left at the target: keys %v, holder %q", tgt.regs, tgt.holder)
	}
}

// rewriteAsV010 writes the volume's record again as v0.1.0 does (format
// 1, without the fields it does not know) and restarts the agent's state
// on it.
func (f *fenceNode) rewriteAsV010(t *testing.T) {
	t.Helper()
	p := filepath.Join(f.a.cfg.StateDir, "volumes", stateFileName("vol"))
	b, err := os.ReadFile(p)
	must(t, "read record", err)
	var rec map[string]any
	must(t, "parse record", json.Unmarshal(b, &rec))
	rec["version"] = 1
	delete(rec, "fence")
	b, err = json.Marshal(rec)
	must(t, "marshal record", err)
	must(t, "write record", os.WriteFile(p, b, 0o600))
	st, err := openStore(filepath.Dir(p))
	must(t, "reopen state", err)
	f.a.state = st
	f.a.locks = newInflight()
}

// A node whose sessions all logged out and in again (new ISIDs, so new
// I_T nexuses, as after a reboot) stages its raw block volume again: its
// key holds the reservation through a nexus it no longer has, which the
// unstage's RELEASE (through another nexus) would not release. The stage
// registers the new nexuses and moves the reservation onto them with a
// PREEMPT of its own key, leaving no stale registration; a stage repeated
// then changes nothing, and the unstage frees the device.
func TestFenceRestageAfterRelogin(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	c := blockCap(snw)
	must(t, "stage", a.stageCap(c, nil))
	stale := tgt.holder
	a.pr.session = 1
	must(t, "stage after the relogin", a.stageCap(c, nil))
	if tgt.holder != stale+"#1" || tgt.holderKey() != NodeKey("node-a") || !a.registered(tgt) {
		t.Fatalf("after the repeated stage: holder %q (before the relogin %q), registrations %v; ops %q", tgt.holder, stale, tgt.regs, tgt.ops)
	}
	gen := tgt.gen
	must(t, "stage repeated", a.stageCap(c, nil))
	if tgt.gen != gen || tgt.holder != stale+"#1" {
		t.Fatalf("a stage repeated on the new nexuses changed the target: generation %d -> %d, holder %q", gen, tgt.gen, tgt.holder)
	}
	must(t, "unstage", a.unstage())
	if len(tgt.regs) != 0 || tgt.holder != "" {
		t.Fatalf("after the unstage: registrations %v, holder %q", tgt.regs, tgt.holder)
	}
}

// The operator's authorisation: it names the holder, is consumed by the
// takeover, expires, and a takeover of another holder is refused.
func TestOperatorTakeover(t *testing.T) {
	dir := t.TempDir()
	auth := NewOperatorAuthority(dir).(*operatorAuthority)
	ctx := context.Background()
	req := TakeoverRequest{VolumeID: "vol", NodeID: "node-b", Holder: NodeKey("node-a")}
	if d, err := auth.AuthorizeTakeover(ctx, req); err != nil || d.Allowed {
		t.Fatalf("without an authorisation: %+v %v", d, err)
	}
	must(t, "write", WriteOperatorTakeover(dir, OperatorTakeover{VolumeID: "vol", FromNode: "node-c", Expires: time.Now().Add(time.Minute)}))
	if d, err := auth.AuthorizeTakeover(ctx, req); err != nil || d.Allowed || !strings.Contains(d.Reason, "node-c") {
		t.Fatalf("another holder named: %+v %v", d, err)
	}
	must(t, "write", WriteOperatorTakeover(dir, OperatorTakeover{VolumeID: "vol", FromNode: "node-a", Expires: time.Now().Add(time.Minute)}))
	if d, err := auth.AuthorizeTakeover(ctx, TakeoverRequest{VolumeID: "other", Holder: NodeKey("node-a")}); err != nil || d.Allowed {
		t.Fatalf("another volume: %+v %v", d, err)
	}
	if d, err := auth.AuthorizeTakeover(ctx, req); err != nil || !d.Allowed || d.HolderNode != "node-a" {
		t.Fatalf("the holder named: %+v %v", d, err)
	}
	if d, _ := auth.AuthorizeTakeover(ctx, req); d.Allowed {
		t.Fatal("the authorisation was not consumed")
	}
	must(t, "write by key", WriteOperatorTakeover(dir, OperatorTakeover{VolumeID: "vol", FromKey: NodeKey("node-a"), Expires: time.Now().Add(time.Minute)}))
	auth.now = func() time.Time { return time.Now().Add(2 * time.Minute) }
	if d, _ := auth.AuthorizeTakeover(ctx, req); d.Allowed || !strings.Contains(d.Reason, "expired") {
		t.Fatalf("expired: %+v", d)
	}
	// An expired authorisation names its node as the holder only if it
	// is the holder.
	for from, holder := range map[string]string{"node-a": "node-a", "node-c": ""} {
		must(t, "write", WriteOperatorTakeover(dir, OperatorTakeover{VolumeID: "vol", FromNode: from, Expires: time.Now().Add(time.Minute)}))
		if d, _ := auth.AuthorizeTakeover(ctx, req); d.Allowed || d.HolderNode != holder {
			t.Fatalf("expired, from %s: %+v, want holder node %q", from, d, holder)
		}
	}
	if ents, _ := os.ReadDir(takeoverDir(dir)); len(ents) != 0 {
		t.Fatalf("left %d files", len(ents))
	}
	for name, bad := range map[string]OperatorTakeover{
		"no holder":    {VolumeID: "vol", Expires: time.Now().Add(time.Minute)},
		"both":         {VolumeID: "vol", FromNode: "a", FromKey: NodeKey("a"), Expires: time.Now().Add(time.Minute)},
		"foreign key":  {VolumeID: "vol", FromKey: 0x1234, Expires: time.Now().Add(time.Minute)},
		"past":         {VolumeID: "vol", FromNode: "a", Expires: time.Now().Add(-time.Minute)},
		"no volume id": {FromNode: "a", Expires: time.Now().Add(time.Minute)},
	} {
		if err := WriteOperatorTakeover(dir, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
	}

	// Through a stage: B takes the volume over from A once.
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	b := newFenceNode(t, "node-b", tgt)
	b.a.cfg.Takeover = []TakeoverAuthority{NewOperatorAuthority(b.a.cfg.StateDir)}
	must(t, "stage on A", a.stage(snw, nil))
	wantFenceCode(t, "B before the operator", b.stage(snw, nil), codes.FailedPrecondition, "berth takeover")
	must(t, "operator", WriteOperatorTakeover(b.a.cfg.StateDir, OperatorTakeover{VolumeID: "vol", FromNode: "node-a", Expires: time.Now().Add(10 * time.Minute)}))
	must(t, "B after the operator", b.stage(snw, nil))
	if tgt.holderKey() != NodeKey("node-b") {
		t.Fatalf("holder %#x", tgt.holderKey())
	}
}

// An NVMe namespace whose host the target lists with key 0 (a
// registrant that writes, left by a REGISTER to key 0, which on NVMe
// replaces the key) is fenced: the stage gives the registration the
// node's key (ignoring the existing one, with a non-zero old key) and
// takes the reservation; the unstage unregisters the key.
func TestFenceNVMeKeyZero(t *testing.T) {
	tgt := newFakePRTarget()
	a := newFenceNode(t, "node-a", tgt)
	a.asNVMe()
	tgt.regs["node-a/fake250-1-p0"] = 0 // the device of stageReq's key "1"
	must(t, "stage", a.stage(snw, nil))
	if tgt.holderKey() != NodeKey("node-a") || !slices.Equal(tgt.keysOf("node-a"), []uint64{NodeKey("node-a")}) {
		t.Fatalf("holder %#x, node-a's keys %#x; ops %q", tgt.holderKey(), tgt.keysOf("node-a"), tgt.ops)
	}
	must(t, "unstage", a.unstage())
	if len(tgt.regs) != 0 || tgt.holder != "" {
		t.Fatalf("after the unstage: registrations %v, holder %q", tgt.regs, tgt.holder)
	}
}

// A takeover that lands between a repeated stage's read (the node's key
// holds the volume) and its REGISTERs: the registrations the stage made
// after it are removed again and the stage is refused, so that the node
// does not write under the new holder's reservation.
func TestFenceRepeatedStageRacesTakeover(t *testing.T) {
	for _, c := range []struct {
		name string
		cap  *csi.VolumeCapability
	}{
		{"single-node", blockCap(snw)},
		{"multi-node", blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)},
	} {
		t.Run(c.name, func(t *testing.T) {
			tgt := newFakePRTarget()
			a := newFenceNode(t, "node-a", tgt)
			b := newFenceNode(t, "node-b", tgt, &allow{allowed: true})
			must(t, "stage on A", a.stageCap(c.cap, nil))
			tgt.beforeRegister = func() { must(t, "B's takeover", b.stageCap(blockCap(snw), nil)) }
			err := a.stageCap(c.cap, nil)
			if tgt.beforeRegister != nil {
				t.Fatal("A's repeated stage registered nothing: the race was not run")
			}
			wantFenceCode(t, "A's repeated stage after the takeover", err, codes.FailedPrecondition, "lost the volume")
			if ks := tgt.keysOf("node-a"); len(ks) != 0 || tgt.holderKey() != NodeKey("node-b") || tgt.mayWrite("node-a/fake250-1-p0") || tgt.mayWrite("node-a/fake250-1-p1") {
				t.Fatalf("after the race: A's keys %x, holder %#x, ops %q", ks, tgt.holderKey(), tgt.ops)
			}
		})
	}
}

// asNVMe makes f's devices NVMe namespace heads: one path (the host's
// registration covers every controller), and reports that name this
// host's registration.
func (f *fenceNode) asNVMe() {
	f.pr.nvme = true
	f.pr.npaths = 1
	f.tr.kind = devices.KindNVMe
	lookup := f.a.lookup
	f.a.lookup = func(name string) (*devices.Device, error) {
		d, err := lookup(name)
		if err == nil {
			d.ID.Kind = devices.KindNVMe
		}
		return d, err
	}
}

// Issue 30's case 7 on NVMe: berth restarted on the holder and the raw
// block stage repeated (it goes through the fence again) sends nothing
// that changes the target, the generation included: the report names
// this host registered with the node's key, and an NVMe REGISTER of
// that same key would succeed and count a generation.
func TestFenceNVMeRestart(t *testing.T) {
	tgt := newFakePRTarget()
	tgt.nvme = true
	a := newFenceNode(t, "node-a", tgt)
	a.asNVMe()
	c := blockCap(snw)
	must(t, "stage", a.stageCap(c, nil))
	st, err := openStore(filepath.Join(a.a.cfg.StateDir, "volumes"))
	must(t, "reopen state", err)
	a.a.state = st
	a.a.locks = newInflight()
	gen, ops := tgt.gen, len(tgt.ops)
	must(t, "stage after the restart", a.stageCap(c, nil))
	if tgt.gen != gen || tgt.holderKey() != NodeKey("node-a") || !a.registered(tgt) {
		t.Fatalf("the repeated stage changed the target: generation %d -> %d, commands %q", gen, tgt.gen, tgt.ops[ops:])
	}
	must(t, "unstage", a.unstage())
	if len(tgt.regs) != 0 || tgt.holder != "" {
		t.Fatalf("after the unstage: registrations %v, holder %q", tgt.regs, tgt.holder)
	}
}
