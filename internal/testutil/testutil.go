// Package testutil holds what the tests of every package share: how a test
// says it needs root or a tool. Run by hand without them, such a test
// skips; under BERTH_CI=1, which .ci/run sets, a skip could hide a
// regression, so it fails instead.
package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// SkipOrFail skips the test, saying why, or fails it under BERTH_CI=1.
func SkipOrFail(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("BERTH_CI") == "1" {
		t.Fatalf("BERTH_CI=1: %s", why)
	}
	t.Skip(why)
}

// RequireRoot skips (fails in CI) a test unless it runs as root and every
// tool is on PATH; why says what the test needs root for.
func RequireRoot(t testing.TB, why string, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		SkipOrFail(t, "needs root ("+why+")")
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			SkipOrFail(t, "needs "+tool+" (make deps)")
		}
	}
}
