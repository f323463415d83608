package iscsi

import (
	"context"
	"log/slog"
	"strings"
	"testing"
)

// Every portal of a multipath volume is a path: one without a session
// (its login never succeeded) makes the volume abnormal and is named;
// the fallback portals of a single-path volume are not.
func TestHealthNamesPortalWithoutSession(t *testing.T) {
	tr := &Transport{log: slog.New(slog.DiscardHandler), sys: sampleSys(t)}
	for _, tc := range []struct {
		multipath string
		named     bool
	}{{"auto", true}, {"true", true}, {"false", false}} {
		v, err := ParseVolume(map[string]string{"iqn": testIQN, "lun": "1", "multipath": tc.multipath,
			"portals": `["10.0.0.1:3260","10.0.0.9:3260"]`}, nil)
		if err != nil {
			t.Fatal(err)
		}
		abnormal, msg := (&Target{t: tr, v: v}).Health(context.Background())
		named := strings.Contains(msg, "portal 10.0.0.9:3260: no session")
		if named != tc.named || (tc.named && !abnormal) {
			t.Errorf("multipath=%s: Health = %v, %q", tc.multipath, abnormal, msg)
		}
	}
}

// PathStates counts one path per portal: the live session of the sample
// tree and a portal with no session.
func TestPathStates(t *testing.T) {
	tr := &Transport{log: slog.New(slog.DiscardHandler), sys: sampleSys(t)}
	v, err := ParseVolume(map[string]string{"iqn": testIQN, "lun": "1",
		"portals": `["10.0.0.1:3260","10.0.0.9:3260"]`}, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := (&Target{t: tr, v: v}).PathStates(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, n := range got {
		total += n
	}
	if total != 2 || got["missing"] != 1 || got["live"]+got["no-lun"] != 1 {
		t.Fatalf("PathStates = %v, want one path per portal, the second missing", got)
	}
}
