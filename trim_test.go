package main

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/testutil"
)

// berth trim wants --volume-id or --all (usage errors exit 2), names a
// volume it has no record of, and says when the node has none.
func TestTrimCommand(t *testing.T) {
	bin := berthBinary(t)
	state := filepath.Join(t.TempDir(), "state")
	run := func(args ...string) (string, int) {
		out, err := exec.Command(bin, append([]string{"trim", "--state-dir=" + state}, args...)...).CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			return string(out), 0
		case errors.As(err, &ee):
			return string(out), ee.ExitCode()
		}
		t.Fatal(err)
		return "", 0
	}
	for _, args := range [][]string{{}, {"--all", "--volume-id=v"}, {"v"}} {
		if out, code := run(args...); code != 2 {
			t.Errorf("berth trim %v: exit %d, want 2 (usage):\n%s", args, code, out)
		}
	}
	testutil.RequireRoot(t, "berth serve")
	if out, code := run("--volume-id=pvc-missing"); code != 1 || !strings.Contains(out, `volume "pvc-missing" is not staged on this node`) {
		t.Errorf("trim of a volume without a record: exit %d:\n%s", code, out)
	}
	if out, code := run("--all"); code != 0 || !strings.Contains(out, "no volume is staged on this node") {
		t.Errorf("trim --all of an empty state directory: exit %d:\n%s", code, out)
	}
}
