package iscsi

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

// TestRemoveDiskSparesAnotherSessionsLUN: a SCSI host's number goes to
// the next session as soon as its own session logs out, so the H:C:T:L a
// detach read may by now name another session's LUN (another volume's,
// mounted). removeDisk must leave such a device alone.
func TestRemoveDiskSparesAnotherSessionsLUN(t *testing.T) {
	tr := testTransport(t, nil)
	root := tr.sys.root.Path()
	h := HCTL{Host: 0, Channel: 0, Target: 0, LUN: 0}
	// The device at 0:0:0:0 is session 7's now; the detach is session 5's.
	dev := filepath.Join(root, "devices/platform/host0/session7/target0:0:0/0:0:0:0")
	for _, d := range []string{dev, filepath.Join(dev, "block", "sdzz9"), filepath.Join(root, "class", "scsi_device", h.String())} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, v := range map[string]string{"state": "running", "delete": ""} {
		if err := os.WriteFile(filepath.Join(dev, name), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(dev, filepath.Join(root, "class", "scsi_device", h.String(), "device")); err != nil {
		t.Fatal(err)
	}
	if err := tr.removeDisk(context.Background(), &Session{ID: 5, Host: 0, State: "FAILED"}, h); err != nil {
		t.Fatalf("removeDisk: %v", err)
	}
	for name, want := range map[string]string{"state": "running", "delete": ""} {
		if b, _ := os.ReadFile(filepath.Join(dev, name)); string(b) != want {
			t.Errorf("session 7's LUN %s: %s is %q, want %q: session 5's detach acted on it", h, name, b, want)
		}
	}
}
