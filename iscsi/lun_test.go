package iscsi

import (
	"context"
	"os"
	"testing"

	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

// TestRemoveDiskSparesAnotherSessionsLUN: a SCSI host's number goes to
// the next session as soon as its own session logs out, so the H:C:T:L a
// detach read may by now name another session's LUN (another volume's,
// mounted). removeDisk must leave such a device alone.
func TestRemoveDiskSparesAnotherSessionsLUN(t *testing.T) {
	h := HCTL{Host: 0, Channel: 0, Target: 0, LUN: 0}
	// The device at 0:0:0:0 is session 7's now; the detach is session 5's.
	const dev = "devices/platform/host0/session7/target0:0:0/0:0:0:0"
	sys := sysfstest.New(t)
	sys.Dir(dev + "/block/sdzz9")
	sys.Files(map[string]string{dev + "/state": "running", dev + "/delete": ""})
	sys.Link("class/scsi_device/"+h.String()+"/device", sys.Root().Path(dev))
	tr := testTransport(t, nil)
	tr.sys = sysTree{root: sys.Root()}
	if err := tr.removeDisk(context.Background(), &Session{ID: 5, Host: 0, State: "FAILED"}, h); err != nil {
		t.Fatalf("removeDisk: %v", err)
	}
	for name, want := range map[string]string{"state": "running", "delete": ""} {
		if b, _ := os.ReadFile(sys.Root().Path(dev, name)); string(b) != want {
			t.Errorf("session 7's LUN %s: %s is %q, want %q: session 5's detach acted on it", h, name, b, want)
		}
	}
}
