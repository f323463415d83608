package metrics

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/fs"
)

type identity struct {
	csi.UnimplementedIdentityServer
}

func (identity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

type node struct {
	csi.UnimplementedNodeServer
}

func (node) NodeStageVolume(_ context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is empty")
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s\n%s", url, resp.Status, body)
	}
	return string(body)
}

func TestMetricsOverGRPCAndHTTP(t *testing.T) {
	vols := []Volume{
		{ID: "pvc-a", Transport: "iscsi", Paths: map[string]int{"live": 1, "failed": 1}, Abnormal: false},
		{ID: "pvc-b", Transport: "nvmeof", Paths: map[string]int{"live": 2}, Abnormal: true, Unfenced: true},
	}
	m := New("berth.test", func(context.Context) []Volume { return vols })

	sock := filepath.Join(t.TempDir(), "csi.sock")
	gl, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(m.UnaryServerInterceptor()))
	csi.RegisterIdentityServer(srv, identity{})
	csi.RegisterNodeServer(srv, node{})
	go srv.Serve(gl)
	defer srv.Stop()

	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- m.Serve(ctx, hl) }()
	defer func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	id, nc := csi.NewIdentityClient(conn), csi.NewNodeClient(conn)
	for i := 0; i < 3; i++ {
		if _, err := id.Probe(ctx, &csi.ProbeRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("NodeStageVolume without id: %v", err)
	}
	if _, err := nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("NodeGetInfo: %v", err)
	}

	body := scrape(t, "http://"+hl.Addr().String()+"/metrics")
	lines := map[string]bool{}
	for _, l := range strings.Split(body, "\n") {
		lines[l] = true
	}
	const op = "csi_plugin_operations_seconds"
	want := []string{
		"# TYPE " + op + " histogram",
		op + `_count{driver_name="berth.test",grpc_status_code="OK",method_name="/csi.v1.Identity/Probe"} 3`,
		op + `_count{driver_name="berth.test",grpc_status_code="OK",method_name="/csi.v1.Node/NodeStageVolume"} 1`,
		op + `_count{driver_name="berth.test",grpc_status_code="InvalidArgument",method_name="/csi.v1.Node/NodeStageVolume"} 1`,
		op + `_count{driver_name="berth.test",grpc_status_code="Unimplemented",method_name="/csi.v1.Node/NodeGetInfo"} 1`,
		`berth_operations_in_flight{method_name="/csi.v1.Identity/Probe"} 0`,
		`berth_volume_staged{transport="iscsi",volume_id="pvc-a"} 1`,
		`berth_volume_staged{transport="nvmeof",volume_id="pvc-b"} 1`,
		`berth_volume_paths{state="live",transport="iscsi",volume_id="pvc-a"} 1`,
		`berth_volume_paths{state="failed",transport="iscsi",volume_id="pvc-a"} 1`,
		`berth_volume_paths{state="live",transport="nvmeof",volume_id="pvc-b"} 2`,
		`berth_volume_abnormal{transport="iscsi",volume_id="pvc-a"} 0`,
		`berth_volume_abnormal{transport="nvmeof",volume_id="pvc-b"} 1`,
		`berth_volume_unfenced{transport="iscsi",volume_id="pvc-a"} 0`,
		`berth_volume_unfenced{transport="nvmeof",volume_id="pvc-b"} 1`,
		"# TYPE berth_mount_table_reads_total counter",
		fmt.Sprintf("berth_mount_table_reads_total %d", fs.MountTableReads()),
	}
	for _, le := range []string{"0.1", "0.25", "0.5", "1", "2.5", "5", "10", "15", "25", "50", "120", "300", "600", "+Inf"} {
		want = append(want, op+`_bucket{driver_name="berth.test",grpc_status_code="OK",method_name="/csi.v1.Identity/Probe",le="`+le+`"} 3`)
	}
	for _, w := range want {
		if !lines[w] {
			t.Errorf("missing series line %s", w)
		}
	}
	if n := strings.Count(body, op+`_bucket{driver_name="berth.test",grpc_status_code="OK",method_name="/csi.v1.Identity/Probe"`); n != len(OperationBuckets)+1 {
		t.Errorf("%d Probe buckets, want %d", n, len(OperationBuckets)+1)
	}
	if !strings.Contains(body, "go_goroutines ") || !strings.Contains(body, "process_start_time_seconds ") {
		t.Error("Go and process collectors missing")
	}
	if t.Failed() {
		t.Logf("scraped:\n%s", body)
	}

	// Unstaged volumes leave with the next scrape.
	vols = vols[:1]
	if body := scrape(t, "http://"+hl.Addr().String()+"/metrics"); strings.Contains(body, "pvc-b") {
		t.Error("pvc-b still exported after it left the volume table")
	}
}

// A bad or busy --metrics-address fails when bound, before berth serves.
func TestListenChecksAddress(t *testing.T) {
	for _, bad := range []string{"9810", "", "127.0.0.1", "127.0.0.1:http", ":65536", ":-1", "[::1]"} {
		if l, err := Listen(bad); err == nil {
			l.Close()
			t.Errorf("Listen(%q) accepted", bad)
		}
	}
	l, err := Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if busy, err := Listen(l.Addr().String()); err == nil {
		busy.Close()
		t.Errorf("Listen on the busy %s accepted", l.Addr())
	}
}

// Each periodic trim moves its result's count and the bytes trimmed;
// every result is exported from the start, at 0.
func TestObserveTrim(t *testing.T) {
	m := New("berth.test", nil)
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- m.Serve(ctx, hl) }()
	defer func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()
	url := "http://" + hl.Addr().String() + "/metrics"
	body := scrape(t, url)
	for _, w := range []string{`berth_trims_total{result="trimmed"} 0`, `berth_trims_total{result="failed"} 0`, `berth_trims_total{result="skipped"} 0`, "berth_trimmed_bytes_total 0"} {
		if !strings.Contains(body, w+"\n") {
			t.Errorf("before any trim: missing %s", w)
		}
	}
	m.ObserveTrim(TrimTrimmed, 3<<20)
	m.ObserveTrim(TrimTrimmed, 1<<20)
	m.ObserveTrim(TrimFailed, 0)
	body = scrape(t, url)
	for _, w := range []string{`berth_trims_total{result="trimmed"} 2`, `berth_trims_total{result="failed"} 1`, `berth_trims_total{result="skipped"} 0`, "berth_trimmed_bytes_total 4.194304e+06"} {
		if !strings.Contains(body, w+"\n") {
			t.Errorf("after three trims: missing %s", w)
		}
	}
	if t.Failed() {
		t.Logf("scraped:\n%s", body)
	}
}
