package devices

import (
	"errors"
	"reflect"
	"slices"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestParseMultipathStatus(t *testing.T) {
	for _, tc := range []struct {
		name, status string
		want         []mpathPath
	}{
		{
			// Two paths in one group, service-time selector (2 args per path).
			"one group", "2 0 0 0 1 1 A 0 2 2 8:16 A 0 0 1 8:32 A 0 0 1 ",
			[]mpathPath{{"8:16", true, 0, 1, "A"}, {"8:32", true, 0, 1, "A"}},
		},
		{
			// Failover: one path per group, the second path failed twice,
			// queueing on (queue_io 1), round-robin (1 arg per path).
			"failover", "2 1 0 1 alua 2 1 A 0 1 1 8:16 A 0 0 E 0 1 1 8:32 F 2 0",
			[]mpathPath{{"8:16", true, 0, 1, "A"}, {"8:32", false, 2, 2, "E"}},
		},
		{
			// Every path gone: the groups are empty.
			"no paths", "2 1 0 0 0 0", nil,
		},
	} {
		got, err := parseMultipathStatus(tc.status)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.name, got, tc.want)
		}
	}
	for _, bad := range []string{
		"",
		"2 0",
		"2 0 0 0 1 1 X 0 1 0 8:16 A 0",
		"2 0 0 0 1 1 A 0 1 0 8:16 Q 0",
		"2 0 0 0 1 1 A 0 1 0 sdb A 0",
		"2 0 0 0 1 1 A 0 2 2 8:16 A 0 0 1",
		"2 0 0 0 1 1 A 0 1 0 8:16 A 0 extra",
		"99999999 0",
		"-1 0 0 0",
	} {
		if got, err := parseMultipathStatus(bad); err == nil {
			t.Errorf("parseMultipathStatus(%q) = %+v, want an error", bad, got)
		}
	}
}

func FuzzParseMultipathStatus(f *testing.F) {
	f.Add("2 0 0 0 1 1 A 0 2 2 8:16 A 0 0 1 8:32 A 0 0 1")
	f.Add("2 1 0 1 alua 2 1 A 0 1 1 8:16 A 0 0 E 0 1 1 8:32 F 2 0")
	f.Fuzz(func(t *testing.T, s string) {
		paths, err := parseMultipathStatus(s)
		if err == nil {
			for _, p := range paths {
				if _, _, err := parseMajorMinor(p.dev); err != nil {
					t.Fatalf("accepted path %q", p.dev)
				}
			}
		}
	})
}

func TestMultipathMapFakeSysfs(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	for _, path := range []string{"sdb", "sdc"} {
		d, err := roots.MultipathMap(path)
		if err != nil || d.Name != "dm-0" || d.ID.DMName != "mpatha" {
			t.Errorf("roots.MultipathMap(%s) = %v %v", path, d, err)
		}
	}
	if _, err := roots.MultipathMap("loop0"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("roots.MultipathMap(loop0) = %v, want ErrNotFound", err)
	}
	if _, err := roots.MultipathMap("sdz"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("roots.MultipathMap(sdz) = %v, want ErrNotFound", err)
	}
}

func TestMultipathFeatures(t *testing.T) {
	for _, c := range []struct {
		line string
		want []string
	}{
		{"1 queue_if_no_path 0 1 1 service-time 0 1 2 8:16 1 1", []string{"queue_if_no_path"}},
		{"3 queue_if_no_path queue_mode bio 1 alua 2 1 round-robin 0 1 1 8:32 1", []string{"queue_if_no_path", "queue_mode", "bio"}},
		{"0 0 1 1 service-time 0 1 2 8:16 1 1", []string{}},
		{"2 pg_init_retries 50 0 1 1 round-robin 0 1 1 8:16 1", []string{"pg_init_retries", "50"}},
		{"", nil},
		{"x queue_if_no_path", nil},
		{"5 queue_if_no_path", nil},
	} {
		if got := multipathFeatures(c.line); !slices.Equal(got, c.want) {
			t.Errorf("multipathFeatures(%q) = %q, want %q", c.line, got, c.want)
		}
	}
}
