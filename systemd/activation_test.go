package systemd

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/internal/testutil"
)

// The socket activation test runs this test binary again, under
// systemd-socket-activate, as a small CSI Identity server built the way
// berth's main is: Listener, Ready, Watchdog(ProbeEndpoint), Stopping.
const (
	childEnv      = "BERTH_SYSTEMD_TEST_SERVER"
	childMountEnv = "BERTH_SYSTEMD_TEST_MOUNT"
)

func TestMain(m *testing.M) {
	if path := os.Getenv(childEnv); path != "" {
		os.Exit(serveActivated(path))
	}
	os.Exit(m.Run())
}

// identity answers Probe until SIGUSR1 wedges it: from then on Probe blocks
// forever, as a deadlocked handler would.
type identity struct {
	csi.UnimplementedIdentityServer
	wedged atomic.Bool
}

func (s *identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: "activation.test.berth", VendorVersion: fmt.Sprint(os.Getpid())}, nil
}

func (s *identity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if s.wedged.Load() {
		select {}
	}
	return &csi.ProbeResponse{}, nil
}

func serveActivated(path string) int {
	log := slog.New(NewLogHandler(os.Stderr, nil))
	if dir := os.Getenv(childMountEnv); dir != "" {
		// Proves the unit's hardening left berth in the host's mount
		// namespace: the test looks for this mount from outside.
		if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64k"); err != nil {
			log.Error("mount", "error", err)
			return 9
		}
	}
	l, err := Listener(path)
	if err != nil || l == nil {
		log.Error("no activated listener", "listener", l, "error", err)
		return 3
	}
	id := &identity{}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, id)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGTERM)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := ProbeEndpoint(path)(ctx); err != nil {
		log.Error("first probe", "error", err)
		return 4
	}
	if err := Ready(); err != nil {
		log.Error("ready", "error", err)
		return 5
	}
	wd := make(chan error, 1)
	go func() { wd <- Watchdog(ctx, log, ProbeEndpoint(path)) }()
	for {
		select {
		case s := <-sigs:
			if s == syscall.SIGUSR1 {
				id.wedged.Store(true)
				continue
			}
			_ = Stopping()
			cancel()
			srv.Stop()
			if err := <-wd; err != nil {
				log.Error("watchdog", "error", err)
				return 6
			}
			return 0
		case err := <-wd:
			log.Error("watchdog returned early", "error", err)
			return 7
		case err := <-served:
			log.Error("serve", "error", err)
			return 8
		}
	}
}

// notifyMessages listens on a NOTIFY_SOCKET in dir and returns its path
// and the lines received, one state per line.
func notifyMessages(t *testing.T, dir string) (string, <-chan string) {
	t.Helper()
	path := filepath.Join(dir, "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	msgs := make(chan string, 1000)
	go func() {
		buf := make([]byte, 4096)
		for {
			n, _, err := conn.ReadFrom(buf)
			if err != nil {
				close(msgs)
				return
			}
			for _, line := range strings.Split(string(buf[:n]), "\n") {
				msgs <- line
			}
		}
	}()
	return path, msgs
}

// expectMessage waits for a notify line that match accepts.
func expectMessage(t *testing.T, msgs <-chan string, what string, match func(string) bool) {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case m, ok := <-msgs:
			if !ok {
				t.Fatalf("notify socket closed waiting for %s", what)
			}
			if match(m) {
				return
			}
		case <-timeout:
			t.Fatalf("no %s on NOTIFY_SOCKET", what)
		}
	}
}

func is(s string) func(string) bool { return func(m string) bool { return m == s } }

// socketActivate runs argv under systemd-socket-activate listening on sock,
// with extra environment, and kills it at the end of the test if needed.
func socketActivate(t *testing.T, sock string, env []string, argv ...string) *exec.Cmd {
	t.Helper()
	tool, err := exec.LookPath("systemd-socket-activate")
	if err != nil {
		testutil.SkipOrFail(t, "needs systemd-socket-activate (make deps): "+err.Error())
	}
	args := []string{"-l", sock}
	for _, e := range env {
		args = append(args, "-E", e)
	}
	cmd := exec.Command(tool, append(args, argv...)...)
	cmd.Stderr = tWriter{t} // Wait returns after the last line is logged
	t.Logf("running %s", strings.Join(cmd.Args, " "))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	// systemd-socket-activate starts the server on the first connection,
	// as systemd does for a socket unit.
	waitFor(t, "the activation socket", func() bool { _, err := os.Stat(sock); return err == nil })
	return cmd
}

func TestSocketActivation(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	notifyPath, msgs := notifyMessages(t, dir)
	const watchdog = 300 * time.Millisecond
	cmd := socketActivate(t, sock, []string{
		childEnv + "=" + sock,
		"NOTIFY_SOCKET=" + notifyPath,
		fmt.Sprintf("WATCHDOG_USEC=%d", watchdog.Microseconds()),
	}, self)

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetPluginInfo through the activated socket: %v", err)
	}
	if info.GetName() != "activation.test.berth" || info.GetVendorVersion() != fmt.Sprint(cmd.Process.Pid) {
		t.Fatalf("GetPluginInfo = %v, want the server started as pid %d", info, cmd.Process.Pid)
	}

	expectMessage(t, msgs, "READY=1", is("READY=1"))
	for i := 0; i < 3; i++ {
		expectMessage(t, msgs, "WATCHDOG=1", is("WATCHDOG=1"))
	}

	// Wedge Probe: pings must stop.
	if err := cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	expectMessage(t, msgs, "liveness failure status", func(m string) bool { return strings.HasPrefix(m, "STATUS=liveness check failing") })
	quiet := time.After(4 * watchdog)
wait:
	for {
		select {
		case m := <-msgs:
			if m == "WATCHDOG=1" {
				t.Fatal("WATCHDOG=1 sent while Probe is wedged")
			}
		case <-quiet:
			break wait
		}
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	expectMessage(t, msgs, "STOPPING=1", is("STOPPING=1"))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("server exited: %v", err)
	}
}
