package reliability

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A row shows the numbers, a column the test did not measure shows "-".
func TestReportFaultRow(t *testing.T) {
	for _, tc := range []struct {
		row  faultRow
		want string
	}{
		{faultRow{name: "silent portal", volumes: 3, rpcs: 9, lost: -1, leaks: 0, took: 41600 * time.Millisecond},
			"| silent portal | 3 | 9 | 0 | - | 0 | 41.6s |"},
		{faultRow{name: "target outage", volumes: 2, rpcs: 57, late: 2, lost: 16384, leaks: 1, took: 65 * time.Second},
			"| target outage | 2 | 57 | 2 | 16384 | 1 | 65.0s |"},
		{faultRow{name: "xfs shut down", volumes: 1, rpcs: 4, lost: -1, leaks: -1},
			"| xfs shut down | 1 | 4 | 0 | - | - | 0.0s |"},
	} {
		if got := tc.row.String(); got != tc.want {
			t.Errorf("row %q, want %q", got, tc.want)
		}
	}
}

// fakeNode answers each RPC after delay with err.
type fakeNode struct {
	csi.NodeClient
	delay time.Duration
	err   error
}

func (n fakeNode) NodeStageVolume(ctx context.Context, _ *csi.NodeStageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	select {
	case <-time.After(n.delay):
		return &csi.NodeStageVolumeResponse{}, n.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

func (n fakeNode) NodeUnstageVolume(context.Context, *csi.NodeUnstageVolumeRequest, ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	return &csi.NodeUnstageVolumeResponse{}, n.err
}

// recordingTB keeps what a Fault reports instead of failing the test.
type recordingTB struct {
	testing.TB
	errors   []string
	cleanups []func()
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
func (r *recordingTB) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *recordingTB) Failed() bool     { return len(r.errors) > 0 }
func (r *recordingTB) Skipped() bool    { return false }
func (r *recordingTB) Name() string     { return "TestFaultExample" }

func (r *recordingTB) end() {
	for _, f := range slices.Backward(r.cleanups) {
		f()
	}
}

// A scenario whose RPC runs past its deadline and that loses bytes fails
// its test, and its row in the table file shows both numbers, with the
// failure below the table.
func TestReportFaultCountsAgainstTheTest(t *testing.T) {
	table := filepath.Join(t.TempDir(), "table.md")
	t.Setenv(TableEnv, table)

	ok := &recordingTB{TB: t}
	f := StartFault(ok, "clean")
	node := f.Node(fakeNode{})
	for _, id := range []string{"vol-1", "vol-2", "vol-1"} {
		if _, err := node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
	}
	f.Lost(0)
	f.Leaked(0)
	ok.end()
	if len(ok.errors) > 0 {
		t.Fatalf("a clean scenario failed its test: %q", ok.errors)
	}

	bad := &recordingTB{TB: t}
	f = StartFault(bad, "lossy")
	node = f.Node(fakeNode{delay: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "vol-3"}); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("stage past its deadline: %v", err)
	}
	// An error of the server's own that says the deadline passed counts too.
	node = f.Node(fakeNode{err: status.Error(codes.DeadlineExceeded, "waited for the device")})
	node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol-3"})
	f.Lost(4096)
	bad.end()
	if len(bad.errors) != 2 || !strings.Contains(bad.errors[0], "2 RPCs ran past their deadline") || !strings.Contains(bad.errors[1], "4096 bytes") {
		t.Errorf("errors of the lossy scenario: %q; want the late RPCs and the lost bytes", bad.errors)
	}

	b, err := os.ReadFile(table + faultSuffix)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	for i, l := range lines {
		lines[i] = seconds.ReplaceAllString(l, "| T |")
	}
	want := []string{"| clean | 2 | 3 | 0 | 0 | 0 | T |", "| lossy | 1 | 2 | 2 | 4096 | - | T |"}
	if len(lines) != 4 || strings.Join(lines[:2], "\n") != faultHeader || !slices.Equal(lines[2:], want) {
		t.Errorf("fault table:\n%s\nwant the header, then\n%s", b, strings.Join(want, "\n"))
	}
	b, err = os.ReadFile(table + failureSuffix)
	if err != nil {
		t.Fatal(err)
	}
	if want := "FAILED fault \"lossy\": TestFaultExample failed, see its output\n"; string(b) != want {
		t.Errorf("failures %q, want %q", b, want)
	}
}

// seconds matches a row's time cell.
var seconds = regexp.MustCompile(`\| [0-9]+\.[0-9]s \|$`)

// The rows a guest printed reach the fault table, not the crash table.
func TestReportFaultsFromGuest(t *testing.T) {
	table := filepath.Join(t.TempDir(), "table.md")
	t.Setenv(TableEnv, table)
	out := "=== RUN   TestFaultSilentPath\n" +
		"\x16" + faultRowMarker + "| silent path | 4 | 12 | 0 | - | 0 | 31s |\n" +
		"[ 12.0] " + faultRowMarker + "| dead shared subsystem | 2 | 10 | 1 | 0 | 0 | 95s |\n" +
		failureMarker + `"fault \"dead shared subsystem\": TestFaultDeadSubsystemUnstage failed, see its output"` + "\n" +
		rowMarker + "| nvmeof/block | 67 | 66 | 665 | 0 | 0 | 90s |\n"
	ReportFaults(t, out)
	b, err := os.ReadFile(table + faultSuffix)
	if err != nil {
		t.Fatal(err)
	}
	want := faultHeader + "\n| silent path | 4 | 12 | 0 | - | 0 | 31s |\n| dead shared subsystem | 2 | 10 | 1 | 0 | 0 | 95s |\n"
	if string(b) != want {
		t.Errorf("fault table %q, want %q", b, want)
	}
	if _, err := os.Stat(table); err == nil {
		t.Errorf("a fault row went to the crash table")
	}
	b, err = os.ReadFile(table + failureSuffix)
	if err != nil || !strings.Contains(string(b), `FAILED fault "dead shared subsystem"`) {
		t.Errorf("failures file %q (%v) lacks the failed scenario", b, err)
	}
}
