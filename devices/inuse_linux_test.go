package devices

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/forklock"
	"github.com/berth-csi/berth/internal/forklock/forklocktest"
	"github.com/berth-csi/berth/internal/testutil"
)

// InUse answers from an exclusive open; that open must not reach a child
// started meanwhile, whose copy would keep the device claimed after the
// check (and the next check would see it in use).
func TestInUseWhileForking(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	d := attachForTest(t, ctx, l, testFile(t, t.TempDir(), "img", 16<<20))
	forklocktest.Fork(t)
	for i := range 2000 {
		if err := InUse(d); err != nil {
			t.Fatalf("check %d while forking: %v", i, err)
		}
	}
	// Held while something claims it, it is in use.
	release := forklock.Hold()
	fd, err := unix.Open(d.Path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	release()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := InUse(d); err == nil {
		t.Fatal("InUse = nil with the device opened exclusively")
	}
}
