package devices

import (
	"path/filepath"
	"testing"

	"github.com/berth-csi/berth/internal/testutil"
)

// FlushPath flushes a device, and a device that is gone has nothing to
// flush.
func TestFlushPath(t *testing.T) {
	if err := FlushPath(filepath.Join(t.TempDir(), "gone")); err != nil {
		t.Errorf("FlushPath of a missing node: %v", err)
	}
	testutil.RequireRoot(t, "loop devices, netlink uevents")
	ctx := testContext(t)
	l := newTestListener(t)
	d := attachForTest(t, ctx, l, testFile(t, t.TempDir(), "img", 1<<20))
	if err := FlushPath(d.Path); err != nil {
		t.Errorf("FlushPath(%s): %v", d.Path, err)
	}
}
