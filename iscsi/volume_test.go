package iscsi

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

const testIQN = "iqn.2003-01.org.linux-iscsi.target:vol1"

func ctxWith(kv ...string) map[string]string {
	m := map[string]string{"iqn": testIQN, "lun": "1", "targetPortal": "10.0.0.1:3260"}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] == "<delete>" {
			delete(m, kv[i])
			continue
		}
		m[kv[i]] = kv[i+1]
	}
	return m
}

var chapSecrets = map[string]string{
	SecretSessionUsername:   "user1",
	SecretSessionPassword:   "s3cret-Passw0rd",
	SecretSessionUsernameIn: "target1",
	SecretSessionPasswordIn: "s3cret-Mutual99",
}

func TestParseVolume(t *testing.T) {
	tests := []struct {
		name    string
		ctx     map[string]string
		secrets map[string]string
		field   string // "" = valid
		check   func(t *testing.T, v *Volume)
	}{
		{name: "minimal", ctx: ctxWith(), check: func(t *testing.T, v *Volume) {
			if v.IQN != testIQN || v.LUN != 1 || len(v.Portals) != 1 || v.Portals[0].Host != "10.0.0.1" || v.Portals[0].Port != 3260 {
				t.Fatalf("got %+v", v)
			}
			if v.Iface != "default" || v.Multipath != "auto" || v.SessionCHAP != nil || v.Discovery {
				t.Fatalf("defaults wrong: %+v", v)
			}
		}},
		{name: "iqn upper case folded", ctx: ctxWith("iqn", "IQN.2003-01.ORG.Example:Disk"), check: func(t *testing.T, v *Volume) {
			if v.IQN != "iqn.2003-01.org.example:disk" {
				t.Fatal(v.IQN)
			}
		}},
		{name: "eui name", ctx: ctxWith("iqn", "eui.0123456789abcdef")},
		{name: "naa name", ctx: ctxWith("iqn", "naa.52004567ba64678d")},
		{name: "portal default port", ctx: ctxWith("targetPortal", "10.0.0.1"), check: func(t *testing.T, v *Volume) {
			if v.Portals[0].Port != 3260 {
				t.Fatal(v.Portals)
			}
		}},
		{name: "portal host name", ctx: ctxWith("targetPortal", "San-1.Example.COM:3261"), check: func(t *testing.T, v *Volume) {
			if v.Portals[0].Host != "san-1.example.com" || v.Portals[0].Port != 3261 {
				t.Fatal(v.Portals)
			}
		}},
		{name: "portal ipv6", ctx: ctxWith("targetPortal", "[fd00::1]:3260"), check: func(t *testing.T, v *Volume) {
			if v.Portals[0].Host != "fd00::1" {
				t.Fatal(v.Portals)
			}
		}},
		{name: "portal with tpgt", ctx: ctxWith("targetPortal", "10.0.0.1:3260,2"), check: func(t *testing.T, v *Volume) {
			if v.Portals[0].TPGT != 2 {
				t.Fatal(v.Portals)
			}
		}},
		{name: "portals json list", ctx: ctxWith("portals", `["10.0.0.2:3260", "10.0.0.3:3260"]`), check: func(t *testing.T, v *Volume) {
			if len(v.Portals) != 3 || v.Portals[1].Host != "10.0.0.2" || v.Portals[2].Host != "10.0.0.3" {
				t.Fatal(v.Portals)
			}
		}},
		{name: "portals comma list with tpgt and duplicate", ctx: ctxWith("portals", "10.0.0.1:3260,10.0.0.2:3260,1,10.0.0.3"), check: func(t *testing.T, v *Volume) {
			if len(v.Portals) != 3 || v.Portals[1].TPGT != 1 || v.Portals[2].Port != 3260 {
				t.Fatal(v.Portals)
			}
		}},
		{name: "portals only", ctx: ctxWith("targetPortal", "<delete>", "portals", "[10.0.0.9:3260]"), check: func(t *testing.T, v *Volume) {
			if len(v.Portals) != 1 || v.Portals[0].Host != "10.0.0.9" {
				t.Fatal(v.Portals)
			}
		}},
		{name: "wwid multipath form", ctx: ctxWith("wwid", "36001405ABCDEF0123456789abcdef012"), check: func(t *testing.T, v *Volume) {
			if v.WWID != "naa.6001405abcdef0123456789abcdef012" {
				t.Fatal(v.WWID)
			}
		}},
		{name: "params", ctx: ctxWith(ParamReplacementTimeout, "5", ParamLoginTimeout, "3", ParamLoginRetryMax, "0"), check: func(t *testing.T, v *Volume) {
			if v.Params[ParamReplacementTimeout] != 5 || v.Params[ParamLoginTimeout] != 3 || v.Params[ParamLoginRetryMax] != 0 {
				t.Fatal(v.Params)
			}
		}},
		{name: "chap mutual", ctx: ctxWith("sessionCHAPAuth", "true"), secrets: chapSecrets, check: func(t *testing.T, v *Volume) {
			if v.SessionCHAP == nil || !v.SessionCHAP.Mutual() || v.SessionCHAP.Password != "s3cret-Passw0rd" {
				t.Fatal("chap not parsed")
			}
		}},
		{name: "chap off ignores secrets", ctx: ctxWith(), secrets: chapSecrets, check: func(t *testing.T, v *Volume) {
			if v.SessionCHAP != nil {
				t.Fatal("chap parsed although disabled")
			}
		}},
		{name: "discovery chap implies discovery", ctx: ctxWith("discoveryCHAPAuth", "true"), secrets: map[string]string{
			SecretDiscoveryUsername: "d", SecretDiscoveryPassword: "dpass"}, check: func(t *testing.T, v *Volume) {
			if !v.Discovery || v.DiscoveryCHAP == nil || v.DiscoveryCHAP.Mutual() {
				t.Fatal("discovery chap")
			}
		}},
		{name: "multipath false", ctx: ctxWith("multipath", "false"), check: func(t *testing.T, v *Volume) {
			if v.Multipath != "false" {
				t.Fatal(v.Multipath)
			}
		}},
		{name: "unknown keys ignored", ctx: ctxWith("csi.storage.k8s.io/pv/name", "pv-1", "transport", "iscsi")},

		{name: "no iqn", ctx: ctxWith("iqn", "<delete>"), field: "iqn"},
		{name: "bad iqn date", ctx: ctxWith("iqn", "iqn.2003-13.org.example:x"), field: "iqn"},
		{name: "bad iqn prefix", ctx: ctxWith("iqn", "target1"), field: "iqn"},
		{name: "iqn newline", ctx: ctxWith("iqn", testIQN+"\n"), field: "iqn"},
		{name: "iqn slash", ctx: ctxWith("iqn", "iqn.2003-01.org.example:a/../b"), field: "iqn"},
		{name: "iqn too long", ctx: ctxWith("iqn", "iqn.2003-01.org.example:"+strings.Repeat("a", 220)), field: "iqn"},
		{name: "eui short", ctx: ctxWith("iqn", "eui.0123"), field: "iqn"},
		{name: "no lun", ctx: ctxWith("lun", "<delete>"), field: "lun"},
		{name: "lun negative", ctx: ctxWith("lun", "-1"), field: "lun"},
		{name: "lun too big", ctx: ctxWith("lun", "16384"), field: "lun"},
		{name: "lun not a number", ctx: ctxWith("lun", "1x"), field: "lun"},
		{name: "no portal", ctx: ctxWith("targetPortal", "<delete>"), field: "targetPortal"},
		{name: "portal bad port", ctx: ctxWith("targetPortal", "10.0.0.1:99999"), field: "targetPortal"},
		{name: "portal bad host", ctx: ctxWith("targetPortal", "bad_host!:3260"), field: "targetPortal"},
		{name: "portal control char", ctx: ctxWith("targetPortal", "10.0.0.1\x00:3260"), field: "targetPortal"},
		{name: "portal zone", ctx: ctxWith("targetPortal", "[fe80::1%eth0]:3260"), field: "targetPortal"},
		{name: "portals bad entry", ctx: ctxWith("portals", `["10.0.0.2:3260","x:y"]`), field: "portals"},
		{name: "iface bad", ctx: ctxWith("iscsiInterface", "../etc"), field: "iscsiInterface"},
		{name: "multipath bad", ctx: ctxWith("multipath", "maybe"), field: "multipath"},
		{name: "chap flag bad", ctx: ctxWith("sessionCHAPAuth", "yes please"), field: "sessionCHAPAuth"},
		{name: "param out of range", ctx: ctxWith(ParamLoginTimeout, "0"), field: ParamLoginTimeout},
		{name: "param not a number", ctx: ctxWith(ParamReplacementTimeout, "5s"), field: ParamReplacementTimeout},
		{name: "wwid control char", ctx: ctxWith("wwid", "naa.1\x07"), field: "wwid"},
		{name: "chap without secrets parses for detach", ctx: ctxWith("sessionCHAPAuth", "true"), check: func(t *testing.T, v *Volume) {
			if v.SessionCHAP != nil || v.CheckSecrets() == nil || !strings.Contains(v.CheckSecrets().Error(), SecretSessionPassword) {
				t.Fatal("missing secrets not reported")
			}
		}},
		{name: "chap with only a user name", ctx: ctxWith("sessionCHAPAuth", "true"), secrets: map[string]string{SecretSessionUsername: "u"}, field: SecretSessionUsername},
		{name: "chap half mutual", ctx: ctxWith("sessionCHAPAuth", "true"), secrets: map[string]string{
			SecretSessionUsername: "u", SecretSessionPassword: "p", SecretSessionUsernameIn: "t"}, field: SecretSessionUsernameIn},
		{name: "chap password newline", ctx: ctxWith("sessionCHAPAuth", "true"), secrets: map[string]string{
			SecretSessionUsername: "u", SecretSessionPassword: "p\nnode.startup = automatic"}, field: SecretSessionPassword},
		{name: "chap password outer blank", ctx: ctxWith("sessionCHAPAuth", "true"), secrets: map[string]string{
			SecretSessionUsername: "u", SecretSessionPassword: " pass"}, field: SecretSessionPassword},
		{name: "chap password too long", ctx: ctxWith("sessionCHAPAuth", "true"), secrets: map[string]string{
			SecretSessionUsername: "u", SecretSessionPassword: strings.Repeat("p", 256)}, field: SecretSessionPassword},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := ParseVolume(tt.ctx, tt.secrets)
			if tt.field == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				if tt.check != nil {
					tt.check(t, v)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted, want an error naming %q", tt.field)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("error %v does not wrap ErrInvalidArgument", err)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("%q", tt.field)) {
				t.Fatalf("error %q does not name field %q", err, tt.field)
			}
			for _, s := range tt.secrets {
				if len(s) > 2 && strings.Contains(err.Error(), s) {
					t.Fatalf("error %q holds a secret", err)
				}
			}
		})
	}
}

func TestVolumeKey(t *testing.T) {
	a, err := ParseVolume(ctxWith("portals", "10.0.0.2:3260"), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := ParseVolume(ctxWith("iqn", strings.ToUpper(testIQN[:3])+testIQN[3:], "targetPortal", "10.0.0.2"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if a.Key() != b.Key() {
		t.Fatalf("same LUN, different keys: %q %q", a.Key(), b.Key())
	}
	c, _ := ParseVolume(ctxWith("lun", "2"), nil)
	if c.Key() == a.Key() {
		t.Fatal("different LUNs, same key")
	}
}

// The identity of a LUN does not depend on the portals it is reached
// through, their spelling or the target name's case; a given WWID names
// the logical unit whatever the target.
func TestVolumeIdentity(t *testing.T) {
	parse := func(kv ...string) *Volume {
		t.Helper()
		v, err := ParseVolume(ctxWith(kv...), nil)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	same := []*Volume{
		parse(),
		parse("targetPortal", "10.0.0.2"),
		parse("targetPortal", "san.example.com:3260"),
		parse("targetPortal", "[fd00::1]:3261", "portals", "10.0.0.1,10.0.0.2:3260"),
		parse("iqn", strings.ToUpper(testIQN)),
	}
	for _, v := range same[1:] {
		if v.Identity() != same[0].Identity() || v.Key() != same[0].Key() {
			t.Errorf("portals %v: identity %q key %q, want %q %q", v.Portals, v.Identity(), v.Key(), same[0].Identity(), same[0].Key())
		}
	}
	if parse("lun", "2").Identity() == same[0].Identity() {
		t.Error("different LUNs, same identity")
	}
	a := parse("wwid", "36001405abcdef")
	b := parse("iqn", "iqn.2003-01.org.linux-iscsi.other:vol9", "lun", "4", "wwid", "naa.6001405ABCDEF", "targetPortal", "10.9.9.9")
	if a.Identity() != b.Identity() {
		t.Errorf("one WWID under two target names: identities %q %q", a.Identity(), b.Identity())
	}
	if parse("wwid", "36001405abcdee").Identity() == a.Identity() {
		t.Error("different WWIDs, same identity")
	}
}

// TestSecretsNotPrinted formats a volume with credentials every way a log
// or error might.
func TestSecretsNotPrinted(t *testing.T) {
	v, err := ParseVolume(ctxWith("sessionCHAPAuth", "true"), chapSecrets)
	if err != nil {
		t.Fatal(err)
	}
	var logged strings.Builder
	slog.New(slog.NewTextHandler(&logged, nil)).Info("attach", "volume", v, "chap", v.SessionCHAP)
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("attach", "volume", v, "chap", v.SessionCHAP)
	outs := []string{
		fmt.Sprintf("%v %+v %#v %s", v.SessionCHAP, v.SessionCHAP, v.SessionCHAP, v.SessionCHAP),
		fmt.Sprintf("%v %+v", *v.SessionCHAP, *v.SessionCHAP),
		logged.String(),
	}
	for _, out := range outs {
		for k, s := range chapSecrets {
			if strings.Contains(k, "password") && strings.Contains(out, s) {
				t.Fatalf("secret %s printed: %s", k, out)
			}
		}
	}
	if !strings.Contains(logged.String(), "CHAP (mutual)") {
		t.Fatalf("log lacks the auth description: %s", logged.String())
	}
}

// New takes node-wide session parameters (from berth's flags) only by
// their names and in their ranges.
func TestNewChecksParams(t *testing.T) {
	ok := map[string]int{ParamReplacementTimeout: 15, ParamLoginTimeout: 5, ParamLoginRetryMax: 0}
	if _, err := New(Options{Params: ok, Listener: new(devices.Listener)}); err != nil {
		t.Fatalf("New(%v): %v", ok, err)
	}
	for _, bad := range []map[string]int{
		{"node.session.foo": 1},
		{ParamLoginTimeout: 0},
		{ParamReplacementTimeout: -1},
	} {
		if _, err := New(Options{Params: bad, Listener: new(devices.Listener)}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("New(%v): %v, want ErrInvalidArgument", bad, err)
		}
	}
}

func FuzzParseVolume(f *testing.F) {
	f.Add(testIQN, "1", "10.0.0.1:3260", `["10.0.0.2:3260","10.0.0.3"]`, "default", "naa.6001405abc", "true", "user", "pass")
	f.Add("eui.0123456789abcdef", "0", "[fd00::1]:3260,1", "a:1,b:2,3", "iface0", "", "false", "", "")
	f.Add("naa.52004567ba64678d", "16383", "host.example", "", "", "36001405", "", "u", "p\n")
	f.Fuzz(func(t *testing.T, iqn, lun, portal, portals, iface, wwid, chap, user, pass string) {
		vc := map[string]string{"iqn": iqn, "lun": lun, "targetPortal": portal, "portals": portals,
			"iscsiInterface": iface, "wwid": wwid, "sessionCHAPAuth": chap}
		sec := map[string]string{SecretSessionUsername: user, SecretSessionPassword: pass}
		v, err := ParseVolume(vc, sec)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("error without ErrInvalidArgument: %v", err)
			}
			if len(pass) > 3 && strings.Contains(err.Error(), pass) {
				t.Fatalf("error holds the password: %v", err)
			}
			return
		}
		// Everything accepted must be safe in argv, sysfs writes and
		// line-based record files.
		for _, s := range []string{v.IQN, v.Iface, v.WWID} {
			if strings.ContainsAny(s, "\n\r\x00") {
				t.Fatalf("control character accepted: %q", s)
			}
		}
		if strings.ContainsAny(v.IQN, "/ ") || strings.Contains(v.Iface, "/") || v.Iface == ".." {
			t.Fatalf("path element accepted: %q %q", v.IQN, v.Iface)
		}
		if v.LUN < 0 || v.LUN > maxLUN || len(v.Portals) == 0 {
			t.Fatalf("bad volume accepted: %+v", v)
		}
		for _, p := range v.Portals {
			if p.Port < 1 || p.Port > 65535 || p.Host == "" || strings.ContainsAny(p.Host, ", \n/") {
				t.Fatalf("bad portal accepted: %+v", p)
			}
		}
		if c := v.SessionCHAP; c != nil {
			if _, err := setRecordValues([]byte("# BEGIN RECORD\n# END RECORD\n"), []setting{{SecretSessionPassword, c.Password}, {SecretSessionUsername, c.Username}}); err != nil {
				t.Fatalf("accepted credentials the record cannot hold: %v", err)
			}
		}
	})
}

// 32 distinct portals are accepted, repeated ones count once, a 33rd is
// refused.
func TestParseVolumePortalLimit(t *testing.T) {
	portals := func(n int) string {
		a := make([]string, n)
		for i := range a {
			a[i] = fmt.Sprintf("10.0.%d.%d:3260", i/250, 1+i%250)
		}
		return strings.Join(a, ",")
	}
	v, err := ParseVolume(ctxWith("portals", portals(32)+","+portals(32)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Portals) != 32 {
		t.Fatalf("%d portals, want 32", len(v.Portals))
	}
	_, err = ParseVolume(ctxWith("portals", portals(33)), nil)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "32") {
		t.Fatalf("33 portals: %v, want an invalid argument naming the limit", err)
	}
}
