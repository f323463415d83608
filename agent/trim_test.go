package agent

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Each volume's turn is at a fixed offset into the interval, at or after
// now and less than an interval away, and the offsets of many volumes
// spread over the interval.
func TestNextTrim(t *testing.T) {
	const interval = time.Hour
	now := time.Date(2026, 12, 4, 19, 30, 0, 0, time.UTC)
	quarters := make([]int, 4)
	for i := range 200 {
		id := fmt.Sprintf("pvc-%d", i)
		next := nextTrim(id, now, interval)
		if next.Before(now) || !next.Before(now.Add(interval)) {
			t.Fatalf("%s: next trim %v, want in [%v, %v)", id, next, now, now.Add(interval))
		}
		if again := nextTrim(id, next.Add(time.Nanosecond), interval); again.Sub(next) != interval {
			t.Fatalf("%s: the turn after %v is %v, want an interval later", id, next, again)
		}
		if nextTrim(id, next, interval) != next {
			t.Fatalf("%s: a turn due now is not now", id)
		}
		quarters[trimOffset(id, interval)*4/interval]++
	}
	for q, n := range quarters {
		if n < 25 {
			t.Errorf("quarter %d of the interval has %d of 200 volumes: %v", q, n, quarters)
		}
	}
}

func TestTrimSkip(t *testing.T) {
	for _, tc := range []struct {
		rec  volumeRecord
		want string
	}{
		{volumeRecord{Staged: true, AccessType: "mount", Mode: snw.String()}, ""},
		{volumeRecord{Staged: false, AccessType: "mount", Mode: snw.String()}, "did not complete"},
		{volumeRecord{Staged: true, AccessType: "block", Mode: snw.String()}, "raw block"},
		{volumeRecord{Staged: true, AccessType: "mount", Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY.String()}, "read-only"},
		{volumeRecord{Staged: true, AccessType: "mount", Mode: snw.String(), MountFlags: []string{"noatime", "ro"}}, "mount flag ro"},
	} {
		got := trimSkip(&tc.rec)
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%+v: skip %q, want %q", tc.rec, got, tc.want)
		}
	}
}
