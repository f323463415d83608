package agent

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A record berth cannot read (empty, or all zeros: a disk or filesystem
// that lost its data) of a volume staged and published is never dropped
// at start-up: the volume's RPCs are refused, naming the file, while its
// mounts and loop device stay; once the record is good again the volume
// unpublishes and unstages.
func TestUnreadableRecordKept(t *testing.T) {
	for _, damaged := range []struct {
		name string
		b    []byte
	}{{"empty", nil}, {"zeros", make([]byte, 512)}} {
		t.Run(damaged.name, func(t *testing.T) {
			h := newHarness(t)
			v := h.newVol("data", 64*mib, mountCap("ext4", snw))
			must(t, "stage", h.stage(v))
			must(t, "publish", h.publish(v, false))
			files := stateFiles(t, h)
			if len(files) != 1 {
				t.Fatalf("%d state files, want 1", len(files))
			}
			good, err := os.ReadFile(files[0])
			must(t, "read record", err)

			h.stop()
			must(t, "damage record", os.WriteFile(files[0], damaged.b, 0o600))
			h.start()
			if b, err := os.ReadFile(files[0]); err != nil || !bytes.Equal(b, damaged.b) {
				t.Errorf("unreadable record not kept as it was at start-up: %q, %v", b, err)
			}
			for _, rpc := range []struct {
				what string
				call func(vol) error
			}{{"unpublish", h.unpublish}, {"unstage", h.unstage}, {"stage", h.stage}} {
				err := rpc.call(v)
				if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), files[0]) {
					t.Errorf("%s of a volume whose record cannot be read: %v (%v), want FailedPrecondition naming %s", rpc.what, status.Code(err), err, files[0])
				}
			}
			if t.Failed() {
				t.FailNow()
			}

			// The operator restores the record.
			h.stop()
			must(t, "restore record", os.WriteFile(files[0], good, 0o600))
			h.start()
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
		})
	}
}
