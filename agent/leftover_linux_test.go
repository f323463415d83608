package agent

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
)

// Files written into a publish target after its bind went (the pod wrote
// into the bare directory) are not berth's to delete: unpublish refuses
// with FailedPrecondition and leaves them, and succeeds once they are gone.
func TestUnpublishLeavesFilesBelowLostBind(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("leftover", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "publish", h.publish(v, false))
	must(t, "umount behind berth's back", unix.Unmount(v.target, 0))
	stray := filepath.Join(v.target, "written-after")
	must(t, "write into the bare target", os.WriteFile(stray, []byte("x"), 0o644))

	wantCode(t, "unpublish over files berth did not make", h.unpublish(v), codes.FailedPrecondition)
	if _, err := os.Stat(stray); err != nil {
		t.Fatalf("refused unpublish removed %s: %v", stray, err)
	}
	must(t, "remove the stray file", os.Remove(stray))
	must(t, "unpublish", h.unpublish(v))
	if _, err := os.Lstat(v.target); !os.IsNotExist(err) {
		t.Errorf("target %s left after unpublish: %v", v.target, err)
	}
	must(t, "unstage", h.unstage(v))
}
