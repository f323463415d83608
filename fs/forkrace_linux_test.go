package fs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/forklock"
	"github.com/berth-csi/berth/internal/forklock/forklocktest"
	"github.com/berth-csi/berth/internal/testutil"
)

// A descriptor berth opens on a mount it is about to unmount must not
// reach a child that this process forks meanwhile: a child holds copies
// of the parent's descriptors from its clone to its exec, and a copy of
// one on the mount makes the unmount fail with EBUSY.
func TestHostUnmountAtWhileForking(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	d, x := mountPointIn(t)
	forklocktest.Fork(t)
	for i := range 2000 {
		tmpfs(t, x)
		if err := UnmountAt(d, "x", nil); err != nil {
			t.Fatalf("unmount %d while forking: %v", i, err)
		}
	}
}

// A descriptor of the mount that goes away a moment later, as a child's
// copy does at its exec, does not fail the unmount; one that stays does.
func TestHostUnmountAtOutlastsBriefHolders(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	d, x := mountPointIn(t)
	for i := range 20 {
		tmpfs(t, x)
		f, err := os.Open(x)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			time.Sleep(3 * time.Millisecond)
			f.Close()
		}()
		if err := UnmountAt(d, "x", nil); err != nil {
			t.Fatalf("unmount %d with a descriptor closed 3 ms later: %v", i, err)
		}
	}
	tmpfs(t, x)
	f, err := os.Open(x)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := UnmountAt(d, "x", nil); !errors.Is(err, unix.EBUSY) {
		t.Fatalf("unmount with a descriptor kept open: %v, want EBUSY", err)
	}
}

// mountPointIn makes a directory x in a new temporary directory, opened
// as d, for UnmountAt(d, "x").
func mountPointIn(t *testing.T) (d *Handle, x string) {
	dir := t.TempDir()
	d, err := OpenPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	x = filepath.Join(dir, "x")
	if err := os.Mkdir(x, 0o755); err != nil {
		t.Fatal(err)
	}
	return d, x
}

// The in-use check's exclusive open must not reach a child started
// meanwhile: a copy keeps the device claimed, and the mkfs or mount
// that follows the check fails with EBUSY.
func TestHostDeviceInUseWhileForking(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dev, _ := newLoop(t, 16<<20)
	forklocktest.Fork(t)
	for i := range 2000 {
		inUse, err := deviceInUse(dev)
		if err != nil || inUse {
			t.Fatalf("check %d: in use %v, %v", i, inUse, err)
		}
		// What mkfs does next; held as well, or its copy in a child
		// would fail the next check.
		release := forklock.Hold()
		fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
		if err == nil {
			unix.Close(fd)
		}
		release()
		if err != nil {
			t.Fatalf("exclusive open %d after the check, while forking: %v", i, err)
		}
	}
}
