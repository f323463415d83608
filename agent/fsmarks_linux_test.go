package agent

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// replaceImage puts a new file of size bytes where the image of v was:
// what a node sees of a LUN that lost its data, or of a new volume put
// behind the old one's name.
func (h *harness) replaceImage(v vol, size int64) string {
	h.t.Helper()
	p := h.root + "/" + v.vctx["file"]
	must(h.t.(*testing.T), "remove image", os.Remove(p))
	return h.image(v.vctx["file"], size)
}

// A volume berth staged with a filesystem is never formatted again: an
// image that reads blank at a later stage is refused, naming the
// filesystem berth made; one holding another filesystem is refused too.
func TestFilesystemMarkSurvivesUnstage(t *testing.T) {
	h := newHarness(t)
	v := h.newVol("data", 64*mib, mountCap("ext4", snw))
	must(t, "stage", h.stage(v))
	must(t, "unstage", h.unstage(v))

	h.replaceImage(v, 64*mib)
	err := h.stage(v)
	wantCode(t, "stage of a volume whose filesystem is gone", err, codes.FailedPrecondition)
	for _, want := range []string{v.id, "ext4", "gone"} {
		if !strings.Contains(status.Convert(err).Message(), want) {
			t.Errorf("stage error %q does not say %q", status.Convert(err).Message(), want)
		}
	}

	img := h.replaceImage(v, 64*mib)
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	err = h.stage(v)
	wantCode(t, "stage of a volume holding another filesystem", err, codes.FailedPrecondition)
	if !strings.Contains(status.Convert(err).Message(), "UUID") {
		t.Errorf("stage error %q does not name the UUIDs", status.Convert(err).Message())
	}
	must(t, "unstage after the refusals", h.unstage(v))

	// The operator who finds the new filesystem intended removes the
	// mark the message names.
	must(t, "remove the mark", os.Remove(h.agent.marks.path(v.id)))
	must(t, "stage once the mark is removed", h.stage(v))
	must(t, "unstage", h.unstage(v))
}
