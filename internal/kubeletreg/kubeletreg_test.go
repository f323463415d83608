package kubeletreg

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// kubelet is the kubelet's side of the registration API: one connection
// per offer, as its plugin watcher makes.
type kubelet struct {
	t    *testing.T
	path string
}

func (k kubelet) client() (registerapi.RegistrationClient, func()) {
	k.t.Helper()
	conn, err := grpc.NewClient("unix://"+k.path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		k.t.Fatal(err)
	}
	return registerapi.NewRegistrationClient(conn), func() { conn.Close() }
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

// socketID tells one socket file from another at the same path: inode
// and change time (a new socket may reuse the inode number). Zero when
// there is none.
type socketID struct {
	ino  uint64
	ctim syscall.Timespec
}

func inode(path string) socketID {
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode().Type() != os.ModeSocket {
		return socketID{}
	}
	st := fi.Sys().(*syscall.Stat_t)
	return socketID{st.Ino, st.Ctim}
}

// waitFor polls cond (the test cannot see the kubelet's inotify events)
// for at most 5 s.
func waitFor(t *testing.T, what string, log *lockedBuffer, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 5 s; log:\n%s", what, log)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func start(t *testing.T, backoff time.Duration) (*Registrar, *lockedBuffer, context.CancelFunc, chan error) {
	t.Helper()
	dir := t.TempDir()
	log := &lockedBuffer{}
	r, err := Listen(Config{
		KubeletDir: dir,
		DriverName: "test.csi.io",
		Endpoint:   filepath.Join(dir, "plugins", "test.csi.io", "csi.sock"),
		Logger:     slog.New(slog.NewTextHandler(log, nil)),
		Backoff:    backoff,
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "plugins_registry", "test.csi.io-reg.sock"); r.Path() != want {
		t.Fatalf("socket %s, want %s", r.Path(), want)
	}
	c, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(c) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return r, log, cancel, done
}

func TestRegistration(t *testing.T) {
	r, log, cancel, done := start(t, 50*time.Millisecond)
	k := kubelet{t, r.Path()}
	cl, closeConn := k.client()
	info, err := cl.GetInfo(ctx(t), &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != "test.csi.io" ||
		info.Endpoint != filepath.Join(filepath.Dir(filepath.Dir(r.Path())), "plugins", "test.csi.io", "csi.sock") ||
		!slices.Equal(info.SupportedVersions, []string{"1.0.0"}) {
		t.Fatalf("GetInfo = %v", info)
	}
	fi, err := os.Lstat(r.Path())
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v, %v; want 0600", fi, err)
	}

	// Refused: logged with the kubelet's error, and the socket is created
	// anew (another inode) so that the plugin watcher offers it again.
	first := inode(r.Path())
	if _, err := cl.NotifyRegistrationStatus(ctx(t), &registerapi.RegistrationStatus{
		PluginRegistered: false, Error: "plugin test.csi.io: NodeGetInfo failed"}); err != nil {
		t.Fatalf("NotifyRegistrationStatus(false): %v", err)
	}
	closeConn()
	waitFor(t, "the refusal logged", log, func() bool {
		return strings.Contains(log.String(), `level=ERROR msg="the kubelet refused the registration; offering again"`) &&
			strings.Contains(log.String(), `error="plugin test.csi.io: NodeGetInfo failed"`)
	})
	waitFor(t, "the socket created anew", log, func() bool {
		ino := inode(r.Path())
		// Its mode is set right after it is bound, which changes its
		// ctime: it is complete once it has the mode.
		fi, err := os.Lstat(r.Path())
		return ino != socketID{} && ino != first && err == nil && fi.Mode().Perm() == 0o600
	})

	// The new socket answers; registered is logged.
	second := inode(r.Path())
	cl, closeConn = k.client()
	defer closeConn()
	if _, err := cl.GetInfo(ctx(t), &registerapi.InfoRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("GetInfo on the new socket: %v", err)
	}
	if _, err := cl.NotifyRegistrationStatus(ctx(t), &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus(true): %v", err)
	}
	waitFor(t, "the registration logged", log, func() bool {
		return regexp.MustCompile(`level=INFO msg="registered with the kubelet" .*driver=test.csi.io`).MatchString(log.String())
	})
	if ino := inode(r.Path()); ino != second {
		t.Fatalf("after a successful registration the socket changed or went: %v, was %v", ino, second)
	}

	// Shutdown removes the socket: the kubelet unregisters the driver.
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	done <- nil
	if _, err := os.Lstat(r.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket after shutdown: %v", err)
	}
}

// Refusals in a row wait longer each time; a stop during the wait ends
// Serve at once, without the socket.
func TestRegistrationBackoff(t *testing.T) {
	r, log, cancel, done := start(t, 100*time.Millisecond)
	k := kubelet{t, r.Path()}
	var offers []time.Time
	for i := 0; i < 3; i++ {
		cl, closeConn := k.client()
		if _, err := cl.GetInfo(ctx(t), &registerapi.InfoRequest{}, grpc.WaitForReady(true)); err != nil {
			t.Fatalf("offer %d: GetInfo: %v", i, err)
		}
		offers = append(offers, time.Now())
		ino := inode(r.Path())
		if _, err := cl.NotifyRegistrationStatus(ctx(t), &registerapi.RegistrationStatus{Error: "refused"}); err != nil {
			t.Fatal(err)
		}
		closeConn()
		waitFor(t, "the socket created anew", log, func() bool { i := inode(r.Path()); return i != socketID{} && i != ino })
	}
	if d := offers[2].Sub(offers[1]); d < 200*time.Millisecond {
		t.Errorf("second retry after %v, want the doubled backoff (200ms)", d)
	}
	cl, closeConn := k.client()
	defer closeConn()
	cl.NotifyRegistrationStatus(ctx(t), &registerapi.RegistrationStatus{Error: "refused"})
	waitFor(t, "the socket removed", log, func() bool { return inode(r.Path()) == socketID{} })
	t0 := time.Now()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	done <- nil
	if d := time.Since(t0); d > time.Second {
		t.Errorf("Serve took %v to stop during a backoff of 800ms", d)
	}
	if _, err := os.Lstat(r.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket after shutdown: %v", err)
	}
}

// A file that is not a socket, or a socket another registrar answers on,
// is left alone; a stale socket is replaced.
func TestListenRefusesForeignFiles(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{KubeletDir: dir, DriverName: "x.csi.io", Endpoint: "/run/x.sock", Logger: slog.New(slog.NewTextHandler(&lockedBuffer{}, nil))}
	path := SocketPath(dir, "x.csi.io")
	os.MkdirAll(filepath.Dir(path), 0o750)
	os.WriteFile(path, []byte("x"), 0o600)
	if _, err := Listen(cfg); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Listen over a regular file: %v", err)
	}
	os.Remove(path)

	r, err := Listen(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(cfg); err == nil || !strings.Contains(err.Error(), "another server") {
		t.Fatalf("Listen while another registrar answers: %v", err)
	}
	// A killed registrar leaves its socket file: the next one replaces it.
	r.lis.(interface{ SetUnlinkOnClose(bool) }).SetUnlinkOnClose(false)
	r.lis.Close()
	if inode(path) == (socketID{}) {
		t.Fatal("the stale socket went away")
	}
	r2, err := Listen(cfg)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	r2.lis.Close()

	for _, bad := range []Config{{KubeletDir: "rel", DriverName: "x", Endpoint: "/x"}, {KubeletDir: dir, Endpoint: "/x"}, {KubeletDir: dir, DriverName: "x", Endpoint: "x.sock"}} {
		if _, err := Listen(bad); err == nil {
			t.Errorf("Listen(%+v) accepted", bad)
		}
	}
}
