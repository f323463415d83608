package agent

import (
	"errors"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

// testImplied is what berth serve's transports declare: keys and the
// transport they select.
var testImplied = map[string]string{"file": "file", "nqn": "nvmeof", "targetTrAddr": "nvmeof", "iqn": "iscsi", "targetPortal": "iscsi"}

func TestTransportName(t *testing.T) {
	for _, tc := range []struct {
		vc   map[string]string
		want string
	}{
		{map[string]string{"file": "a.img"}, "file"},
		{map[string]string{"nqn": "nqn.2014-08.org:x", "targetTrAddr": "10.0.0.1"}, "nvmeof"},
		{map[string]string{"iqn": "iqn.2003-01.org:x", "targetPortal": "10.0.0.1:3260"}, "iscsi"},
		{map[string]string{"transport": "iscsi", "file": "a.img"}, "iscsi"},
		{map[string]string{"nqn": "x", "iqn": "y"}, ""},
		{map[string]string{"transport": ""}, ""},
		{map[string]string{"other": "x"}, ""},
		{nil, ""},
	} {
		got, err := transportName(tc.vc, testImplied)
		if got != tc.want || (tc.want == "") != (err != nil) {
			t.Errorf("transportName(%v) = %q, %v; want %q", tc.vc, got, err, tc.want)
		}
	}
}

// The transports' declared keys select them; a transport declared but not
// served is refused by name, one never declared as naming none.
func TestSelectTransport(t *testing.T) {
	fake := newFakeTransport()
	implied, err := impliedTransports([]Transport{fake}, []TransportKind{{Name: "iscsi", Keys: []string{"iqn", "targetPortal"}}})
	must(t, "impliedTransports", err)
	ts := map[string]Transport{"fake": fake}
	if tr, err := selectTransport(map[string]string{"fake": "1"}, implied, ts); err != nil || tr != Transport(fake) {
		t.Fatalf("fake key: %v, %v", tr, err)
	}
	for _, tc := range []struct {
		vc   map[string]string
		want string
	}{
		{map[string]string{"iqn": "iqn.2003-01.org:x"}, `volume_context: transport "iscsi" is not enabled on this node (enabled: [fake])`},
		{map[string]string{"transport": "nvmeof"}, `volume_context: transport "nvmeof" is not enabled on this node (enabled: [fake])`},
		{map[string]string{"fake": "1", "targetPortal": "p"}, `volume_context: keys of several transports [fake iscsi]; set "transport" to choose`},
		{map[string]string{"nqn": "x"}, `volume_context: names no transport (set "transport", or give a key that selects one: ["fake" "iqn" "targetPortal"])`},
	} {
		_, err := selectTransport(tc.vc, implied, ts)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), tc.want+":") {
			t.Errorf("selectTransport(%v) = %v, want %q", tc.vc, err, tc.want)
		}
	}
}

// Two transports with one name, or one key, are refused.
func TestImpliedTransportsConflicts(t *testing.T) {
	fake := newFakeTransport()
	for name, tc := range map[string]struct {
		enabled  []Transport
		disabled []TransportKind
	}{
		"enabled twice":         {[]Transport{fake, fake}, nil},
		"enabled and disabled":  {[]Transport{fake}, []TransportKind{{Name: "fake"}}},
		"key of two transports": {[]Transport{fake}, []TransportKind{{Name: "other", Keys: []string{"fake"}}}},
		"transport as a key":    {nil, []TransportKind{{Name: "other", Keys: []string{ContextTransport}}}},
		"empty key":             {nil, []TransportKind{{Name: "other", Keys: []string{""}}}},
		"kind without a name":   {nil, []TransportKind{{Keys: []string{"k"}}}},
	} {
		if m, err := impliedTransports(tc.enabled, tc.disabled); err == nil {
			t.Errorf("%s: accepted: %v", name, m)
		}
	}
}
