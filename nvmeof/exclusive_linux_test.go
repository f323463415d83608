package nvmeof

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/forklock"
	"github.com/berth-csi/berth/internal/forklock/forklocktest"
	"github.com/berth-csi/berth/internal/testutil"
)

// openedExclusively's own exclusive open must not reach a child started
// meanwhile: the copy would keep the device claimed, and the next look
// (the detach's, a stage's) would find it held.
func TestOpenedExclusivelyWhileForking(t *testing.T) {
	testutil.RequireRoot(t, "a loop device")
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", dev).Run() })
	forklocktest.Fork(t)
	for i := range 2000 {
		if openedExclusively(dev) {
			t.Fatalf("look %d while forking: %s held, though nothing holds it", i, dev)
		}
	}
	release := forklock.Hold()
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	release()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if !openedExclusively(dev) {
		t.Fatalf("%s opened exclusively, but openedExclusively = false", dev)
	}
}
