package agent

import (
	"os"
	"os/exec"
	"testing"
)

// requireRoot skips a test that needs root and the given tools when run
// by hand without them. Under BERTH_CI=1 the missing requirement is a
// failure: CI must run these tests.
func requireRoot(t testing.TB, tools ...string) {
	t.Helper()
	why := ""
	if os.Geteuid() != 0 {
		why = "needs root (loop devices, mounts)"
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil && why == "" {
			why = "needs " + tool + " (make deps)"
		}
	}
	if why == "" {
		return
	}
	if os.Getenv("BERTH_CI") == "1" {
		t.Fatalf("BERTH_CI=1: %s", why)
	}
	t.Skip(why)
}

func mkdirAll(p string) error { return os.MkdirAll(p, 0o750) }
