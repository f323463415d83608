package vm

import (
	"fmt"
	"maps"
	"slices"
	"testing"
)

// fatalRecorder is a testing.TB whose Fatalf records the message and
// returns.
type fatalRecorder struct {
	testing.TB
	fatal string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) { r.fatal = fmt.Sprintf(format, args...) }

func TestGroups(t *testing.T) {
	all := []string{"block", "multipath", "timings"}
	for _, tc := range []struct {
		names string
		want  []string
		fatal bool
	}{
		{"", all, false},
		{"multipath", []string{"multipath"}, false},
		{"timings,block", []string{"block", "timings"}, false},
		{"block,nosuch", nil, true},
		{"block,", nil, true},
	} {
		r := &fatalRecorder{TB: t}
		got := groups(r, "BERTH_X_CASES", tc.names, all)
		if tc.fatal {
			if r.fatal == "" {
				t.Errorf("%q: no failure, groups %v", tc.names, got)
			}
			continue
		}
		if r.fatal != "" || !slices.Equal(slices.Sorted(maps.Keys(got)), slices.Sorted(slices.Values(tc.want))) {
			t.Errorf("%q: groups %v (failure %q), want %v", tc.names, got, r.fatal, tc.want)
		}
	}
}
