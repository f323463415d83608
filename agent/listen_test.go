package agent

import (
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/testutil"
)

// A second listener on one endpoint is refused by the lock beside the
// socket, and the refusal names the process that holds it.
func TestListenRefusesSecondNamingHolder(t *testing.T) {
	dir := t.TempDir()
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	first, err := Listen(endpoint)
	must(t, "Listen", err)
	defer first.Close()
	second, err := Listen(endpoint)
	if err == nil {
		second.Close()
		t.Fatal("second Listen on one endpoint succeeded")
	}
	if !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("the refusal does not name the holder's pid %d: %v", os.Getpid(), err)
	}
	must(t, "close", first.Close())
	third, err := Listen(endpoint)
	must(t, "Listen after the holder closed", err)
	must(t, "close", third.Close())
}

// A listener's Close removes its own socket file only: a socket file
// another server put at the path stays.
func TestListenCloseLeavesForeignSocket(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "csi.sock")
	lis, err := Listen("unix://" + path)
	must(t, "Listen", err)

	other, err := net.Listen("unix", filepath.Join(dir, "other.sock"))
	must(t, "listen other", err)
	other.(*net.UnixListener).SetUnlinkOnClose(false)
	defer other.Close()
	must(t, "replace the socket file", os.Rename(filepath.Join(dir, "other.sock"), path))
	want, err := os.Lstat(path)
	must(t, "lstat", err)

	must(t, "close", lis.Close())
	got, err := os.Lstat(path)
	if err != nil {
		t.Fatalf("Close removed a socket file it did not create: %v", err)
	}
	if !os.SameFile(want, got) {
		t.Fatal("socket file changed")
	}
}

// A second agent on one state directory is refused before it reads or
// cleans anything there, naming the holder; Close frees the directory.
func TestNewLocksStateDir(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts") // New opens a uevent listener
	state := t.TempDir()
	cfg := Config{NodeID: "n", StateDir: state, Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))}
	first, err := New(cfg)
	must(t, "New", err)
	defer first.Close()

	volumes := filepath.Join(state, "volumes")
	leftover := filepath.Join(volumes, ".tmp-write")
	must(t, "write a half-written record", os.WriteFile(leftover, nil, 0o600))
	second, err := New(cfg)
	if err == nil {
		second.Close()
		t.Fatal("second New on one state directory succeeded")
	}
	if !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) || !strings.Contains(err.Error(), state) {
		t.Fatalf("the refusal names neither the directory nor the holder's pid %d: %v", os.Getpid(), err)
	}
	if _, err := os.Stat(leftover); err != nil {
		t.Fatalf("the refused agent touched the state directory: %v", err)
	}

	must(t, "close", first.Close())
	third, err := New(cfg)
	must(t, "New after the holder closed", err)
	must(t, "close", third.Close())
}

func TestSocketPath(t *testing.T) {
	for ep, want := range map[string]string{
		"unix:///run/berth/csi.sock": "/run/berth/csi.sock",
		"unix:/run/berth/csi.sock":   "/run/berth/csi.sock",
		"/run/berth/csi.sock":        "/run/berth/csi.sock",
		"tcp://127.0.0.1:10000":      "",
		"unix://relative.sock":       "",
		"unix:///run/../csi.sock":    "",
	} {
		got, err := SocketPath(ep)
		if got != want || (want == "") != (err != nil) {
			t.Errorf("SocketPath(%q) = %q, %v; want %q", ep, got, err, want)
		}
	}
}
