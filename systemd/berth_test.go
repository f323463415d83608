package systemd

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

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

func freeLoopbackPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestBerthSocketActivated runs the real berth binary the way berth.service
// does: socket-activated, Type=notify, with a watchdog and metrics.
func TestBerthSocketActivated(t *testing.T) {
	testutil.RequireRoot(t, "berth serve refuses to start without it", "systemd-socket-activate")
	bin := berthBinary(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	notifyPath, msgs := notifyMessages(t, dir)
	metricsAddr := freeLoopbackPort(t)
	cmd := socketActivate(t, sock, []string{
		"NOTIFY_SOCKET=" + notifyPath,
		fmt.Sprintf("WATCHDOG_USEC=%d", (2 * time.Second).Microseconds()),
	}, bin, "serve", "--endpoint=unix://"+sock, "--state-dir="+filepath.Join(dir, "state"),
		"--node-id=node-a", "--log-format=json", "--metrics-address="+metricsAddr)

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id := csi.NewIdentityClient(conn)
	info, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetPluginInfo through the activated socket: %v", err)
	}
	if info.GetName() != "berth.csi.io" {
		t.Fatalf("GetPluginInfo = %v", info)
	}
	expectMessage(t, msgs, "READY=1", is("READY=1"))
	if _, err := id.Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatalf("Probe: %v", err)
	}
	for i := 0; i < 2; i++ {
		expectMessage(t, msgs, "WATCHDOG=1", is("WATCHDOG=1"))
	}

	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatalf("scrape --metrics-address: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	want := `csi_plugin_operations_seconds_count{driver_name="berth.csi.io",grpc_status_code="OK",method_name="/csi.v1.Identity/GetPluginInfo"} 1`
	if !strings.Contains(string(body), want+"\n") {
		t.Errorf("metrics lack %s:\n%s", want, body)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	expectMessage(t, msgs, "STOPPING=1", is("STOPPING=1"))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("berth exited: %v", err)
	}
	// The socket belongs to the socket unit: berth must leave it for the
	// next start.
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("activation socket after berth exited: %v %v", fi, err)
	}
}
