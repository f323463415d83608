package reliability

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/test/vm"
)

const faultHeader = "| fault | volumes | RPCs | RPCs past deadline | bytes lost | leaks | time |\n|---|---|---|---|---|---|---|"

// rpcDeadline is the deadline the kubelet gives each node RPC: a Fault's
// Node gives it to an RPC whose context has none or a later one.
const rpcDeadline = 2 * time.Minute

// A Fault is the account of one fault scenario, one row of make
// reliability's fault table. Its Node counts the RPCs, the volumes they
// name and the RPCs that ran past their deadline; the test adds the bytes
// it wrote and synced before the fault that are missing after it (Lost)
// and what the scenario left behind (Leaked). A column the test does not
// measure shows "-".
//
// The row is reported when the test ends, passed or failed, with what was
// counted until then; an RPC past its deadline, a lost byte or a leak
// fails the test, so that the row and the test agree. In a guest the row
// goes to the output, for the host entry point's ReportFaults. A row
// reaches make reliability's table when the test, or its host entry
// point, is in the Makefile's FAULT_TESTS (which make reliability runs,
// and unit-test and vm-test skip).
type Fault struct {
	t     testing.TB
	name  string
	start time.Time

	mu      sync.Mutex
	volumes map[string]bool
	rpcs    int
	late    []string // the RPCs past their deadline, each with its times
	lost    int64
	leaks   int
	// lostKnown and leaksKnown tell that the test measured them.
	lostKnown, leaksKnown bool
}

// StartFault starts the account of the fault scenario name (the table's
// first column), reported when t ends.
func StartFault(t testing.TB, name string) *Fault {
	f := &Fault{t: t, name: name, start: time.Now(), volumes: map[string]bool{}}
	t.Cleanup(f.report)
	return f
}

// Lost adds n bytes that were written and synced before the fault and
// are missing (or differ) after it; Lost(0) records that none are.
func (f *Fault) Lost(n int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lost += n
	f.lostKnown = true
}

// Leaked adds n objects the scenario left on the node (mounts, devices,
// sessions, controllers, records); Leaked(0) records that none are.
func (f *Fault) Leaked(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leaks += n
	f.leaksKnown = true
}

// Node returns node with its volume RPCs counted: each runs with its
// context's deadline, or rpcDeadline when that is sooner, and one that
// answers DeadlineExceeded or after its deadline is past it. A test that
// expects an RPC to run out its deadline does not call it through Node.
func (f *Fault) Node(node csi.NodeClient) csi.NodeClient { return faultNode{node, f} }

// faultNode counts the volume RPCs of its NodeClient; NodeGetInfo and
// NodeGetCapabilities pass through.
type faultNode struct {
	csi.NodeClient
	f *Fault
}

var _ csi.NodeClient = faultNode{}

func (n faultNode) NodeStageVolume(ctx context.Context, in *csi.NodeStageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	return timed(ctx, n.f, "NodeStageVolume", in.GetVolumeId(), func(ctx context.Context) (*csi.NodeStageVolumeResponse, error) {
		return n.NodeClient.NodeStageVolume(ctx, in, opts...)
	})
}

func (n faultNode) NodeUnstageVolume(ctx context.Context, in *csi.NodeUnstageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	return timed(ctx, n.f, "NodeUnstageVolume", in.GetVolumeId(), func(ctx context.Context) (*csi.NodeUnstageVolumeResponse, error) {
		return n.NodeClient.NodeUnstageVolume(ctx, in, opts...)
	})
}

func (n faultNode) NodePublishVolume(ctx context.Context, in *csi.NodePublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error) {
	return timed(ctx, n.f, "NodePublishVolume", in.GetVolumeId(), func(ctx context.Context) (*csi.NodePublishVolumeResponse, error) {
		return n.NodeClient.NodePublishVolume(ctx, in, opts...)
	})
}

func (n faultNode) NodeUnpublishVolume(ctx context.Context, in *csi.NodeUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error) {
	return timed(ctx, n.f, "NodeUnpublishVolume", in.GetVolumeId(), func(ctx context.Context) (*csi.NodeUnpublishVolumeResponse, error) {
		return n.NodeClient.NodeUnpublishVolume(ctx, in, opts...)
	})
}

func (n faultNode) NodeGetVolumeStats(ctx context.Context, in *csi.NodeGetVolumeStatsRequest, opts ...grpc.CallOption) (*csi.NodeGetVolumeStatsResponse, error) {
	return timed(ctx, n.f, "NodeGetVolumeStats", in.GetVolumeId(), func(ctx context.Context) (*csi.NodeGetVolumeStatsResponse, error) {
		return n.NodeClient.NodeGetVolumeStats(ctx, in, opts...)
	})
}

func (n faultNode) NodeExpandVolume(ctx context.Context, in *csi.NodeExpandVolumeRequest, opts ...grpc.CallOption) (*csi.NodeExpandVolumeResponse, error) {
	return timed(ctx, n.f, "NodeExpandVolume", in.GetVolumeId(), func(ctx context.Context) (*csi.NodeExpandVolumeResponse, error) {
		return n.NodeClient.NodeExpandVolume(ctx, in, opts...)
	})
}

// timed runs one RPC of volume with its deadline and counts it in f.
func timed[R any](ctx context.Context, f *Fault, name, volume string, rpc func(context.Context) (R, error)) (R, error) {
	deadline := rpcDeadline
	if d, ok := ctx.Deadline(); ok {
		deadline = min(deadline, time.Until(d))
	}
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	start := time.Now()
	r, err := rpc(ctx)
	f.count(name, volume, time.Since(start), deadline, err)
	return r, err
}

func (f *Fault) count(name, volume string, took, deadline time.Duration, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rpcs++
	if volume != "" {
		f.volumes[volume] = true
	}
	if status.Code(err) == codes.DeadlineExceeded || took > deadline {
		f.late = append(f.late, fmt.Sprintf("%s %s ran %v of its %v: %v",
			name, volume, took.Round(time.Millisecond), deadline.Round(time.Millisecond), err))
	}
}

// report fails the test for what the row counts against it, and reports
// the row: in a guest to the output, on the host to the fault table file.
func (f *Fault) report() {
	if f.t.Skipped() {
		return
	}
	f.mu.Lock()
	r := faultRow{name: f.name, volumes: len(f.volumes), rpcs: f.rpcs, late: len(f.late), lost: -1, leaks: -1, took: time.Since(f.start)}
	if f.lostKnown {
		r.lost = f.lost
	}
	if f.leaksKnown {
		r.leaks = f.leaks
	}
	late := f.late
	f.mu.Unlock()

	if len(late) > 0 {
		f.t.Errorf("fault %q: %d RPCs ran past their deadline:\n\t%s", f.name, len(late), strings.Join(late, "\n\t"))
	}
	if r.lost > 0 {
		f.t.Errorf("fault %q: %d bytes written and synced before the fault are missing after it", f.name, r.lost)
	}
	if r.leaks > 0 {
		f.t.Errorf("fault %q: %d objects left behind", f.name, r.leaks)
	}
	row := r.String()
	f.t.Logf("fault table row: %s", row)
	var failures []string
	if f.t.Failed() {
		failures = append(failures, fmt.Sprintf("fault %q: %s failed, see its output", f.name, f.t.Name()))
	}
	if vm.InGuest() {
		printGuestReport(faultRowMarker, []string{row}, failures)
		return
	}
	if err := appendReport(faultSuffix, faultHeader, []string{row}, failures); err != nil {
		f.t.Errorf("fault table: %v", err)
	}
}

// faultRow is one line of the fault table; lost and leaks are -1 when
// not measured.
type faultRow struct {
	name          string
	volumes, rpcs int
	late          int
	lost          int64
	leaks         int
	took          time.Duration
}

func (r faultRow) String() string {
	unknown := func(n int64) string {
		if n < 0 {
			return "-"
		}
		return fmt.Sprint(n)
	}
	return fmt.Sprintf("| %s | %d | %d | %d | %s | %s | %.1fs |", r.name, r.volumes, r.rpcs, r.late,
		unknown(r.lost), unknown(int64(r.leaks)), r.took.Seconds())
}

// ReportFaults adds the fault table rows a guest reported (its output,
// vm.Machine.Output) to the fault table file, and the accounts of its
// failed scenarios to the failures file. The host entry point of a
// guest whose tests start a Fault calls it.
func ReportFaults(t *testing.T, guestOutput string) {
	t.Helper()
	rows := markedLines(guestOutput, faultRowMarker)
	for _, r := range rows {
		t.Logf("fault table row: %s", r)
	}
	if err := appendReport(faultSuffix, faultHeader, rows, guestFailures(guestOutput)); err != nil {
		t.Error(err)
	}
}
