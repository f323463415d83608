package nvmeof

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

// makeKey returns the DHHC-1 representation of n key bytes (each fill)
// for hash id h, with the CRC-32 nvme-cli appends.
func makeKey(h, n int, fill byte) string {
	key := bytes.Repeat([]byte{fill}, n)
	b := binary.LittleEndian.AppendUint32(key, crc32.ChecksumIEEE(key))
	return fmt.Sprintf("DHHC-1:%02d:%s:", h, base64.StdEncoding.EncodeToString(b))
}

// badCRCKey is a 32-byte key whose CRC does not match.
func badCRCKey() string {
	key := bytes.Repeat([]byte{7}, 32)
	b := binary.LittleEndian.AppendUint32(key, crc32.ChecksumIEEE(key)^1)
	return "DHHC-1:00:" + base64.StdEncoding.EncodeToString(b) + ":"
}

func TestParseDHCHAPKey(t *testing.T) {
	good := []struct {
		key     string
		hash    int
		keySize int
	}{
		{makeKey(0, 32, 1), 0, 32},
		{makeKey(0, 48, 2), 0, 48},
		{makeKey(0, 64, 3), 0, 64},
		{makeKey(1, 32, 4), 1, 32},
		{makeKey(2, 48, 5), 2, 48},
		{makeKey(3, 64, 6), 3, 64},
		// The kernel transforms a key of any of the three sizes with
		// any hash; so does berth.
		{makeKey(1, 64, 8), 1, 64},
		// Made by nvme-cli 2.4's gen-dhchap-key (--hmac=0..3).
		{"DHHC-1:00:Pi0k1Lj5xvV7AbRnUcopIrPuwtqI8USmT7Q7yPFYxWbFJ6bn:", 0, 32},
		{"DHHC-1:01:mN4hSGOpVgcveQTnCoXtUbEYjGquXEbtx5Sg17oEs18YWTAo:", 1, 32},
		{"DHHC-1:02:eUvZcStlkuM5pxvkAZ+9O9GkqofyqBkdu8EFpdslhZg2gn8Ar69y1hh4Df4Ot4PN227ZGA==:", 2, 48},
		{"DHHC-1:03:Qdwt9GiOJv3/uaz7qnzyk87doMyasOVnyf0E2TcSwXW0/MgAEVFan408Q8p8IzMTRRy7NbMCOOVmVQArkYaloCO6abQ=:", 3, 64},
		// Without the base64 padding.
		{strings.TrimRight(strings.TrimSuffix(makeKey(2, 48, 9), ":"), "=") + ":", 2, 48},
	}
	for _, g := range good {
		k, err := ParseDHCHAPKey(SecretDHCHAPKey, g.key)
		if err != nil {
			t.Errorf("ParseDHCHAPKey(%q): %v", g.key, err)
			continue
		}
		if k.Hash() != g.hash || k.Size() != g.keySize {
			t.Errorf("ParseDHCHAPKey(%q): hash %d size %d, want %d %d", g.key, k.Hash(), k.Size(), g.hash, g.keySize)
		}
		// The key prints without its secret part.
		for _, s := range []string{k.String(), fmt.Sprintf("%v", k), fmt.Sprintf("%+v", *k), fmt.Sprintf("%#v", k)} {
			if strings.Contains(s, g.key[10:20]) {
				t.Errorf("%q prints the key", s)
			}
		}
	}

	valid := makeKey(1, 32, 0x42)
	secretPart := valid[len("DHHC-1:01:") : len(valid)-1]
	bad := []struct {
		name, key, want string
	}{
		{"empty", "", "empty"},
		{"version", "DHHC-2" + valid[6:], "DHHC-1"},
		{"no prefix", secretPart, "DHHC-1"},
		{"hash id", "DHHC-1:04:" + secretPart + ":", "hash"},
		{"hash id not hex", "DHHC-1:0x:" + secretPart + ":", "hash"},
		{"hash id one digit", "DHHC-1:1:" + secretPart + ":", "hash"},
		{"no trailing colon", strings.TrimSuffix(valid, ":"), "colon"},
		{"extra field", valid + "x:", "colon"},
		{"bad base64", "DHHC-1:01:" + secretPart[:10] + "!" + secretPart[11:] + ":", "base64"},
		{"bad CRC", badCRCKey(), "CRC"},
		{"short", makeKey(0, 16, 1), "length"},
		{"31 bytes", makeKey(0, 31, 1), "length"},
		{"long", makeKey(0, 128, 1), "length"},
		{"comma", "DHHC-1:01:" + secretPart[:10] + "," + secretPart[11:] + ":", "base64"},
		{"newline", valid + "\n", "colon"},
	}
	for _, b := range bad {
		t.Run(b.name, func(t *testing.T) {
			_, err := ParseDHCHAPKey(SecretDHCHAPKey, b.key)
			if err == nil {
				t.Fatalf("ParseDHCHAPKey accepted %q", b.key)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("error %v does not wrap ErrInvalidArgument", err)
			}
			msg := err.Error()
			if !strings.Contains(msg, SecretDHCHAPKey) || !strings.Contains(msg, b.want) {
				t.Errorf("error %q: want the secret's name and %q", msg, b.want)
			}
			if len(b.key) > 12 && strings.Contains(msg, b.key[10:len(b.key)-2]) || strings.Contains(msg, secretPart[:8]) {
				t.Errorf("error %q holds the secret", msg)
			}
		})
	}
}

func TestParseAuth(t *testing.T) {
	host, ctrl := makeKey(1, 32, 1), makeKey(3, 64, 2)
	for _, tc := range []struct {
		name    string
		secrets map[string]string
		host    bool
		ctrl    bool
		err     string
	}{
		{"none", nil, false, false, ""},
		{"unrelated", map[string]string{"password": "x"}, false, false, ""},
		{"host", map[string]string{SecretDHCHAPKey: host}, true, false, ""},
		{"both", map[string]string{SecretDHCHAPKey: host, SecretDHCHAPCtrlKey: ctrl}, true, true, ""},
		{"kernel names", map[string]string{"dhchap_secret": host, "dhchap_ctrl_secret": ctrl}, true, true, ""},
		{"both names agree", map[string]string{"dhchap_secret": host, SecretDHCHAPKey: host}, true, false, ""},
		{"names disagree", map[string]string{"dhchap_secret": host, SecretDHCHAPKey: ctrl}, false, false, "disagree"},
		{"ctrl only", map[string]string{SecretDHCHAPCtrlKey: ctrl}, false, false, "needs"},
		{"same key both ways", map[string]string{SecretDHCHAPKey: host, SecretDHCHAPCtrlKey: host}, false, false, "same"},
		{"typo", map[string]string{"dhchapSecrets": host}, false, false, "unknown"},
		{"bad ctrl", map[string]string{SecretDHCHAPKey: host, SecretDHCHAPCtrlKey: badCRCKey()}, false, false, "CRC"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, err := ParseAuth(tc.secrets)
			if tc.err != "" {
				if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("ParseAuth: %v, want an invalid argument error about %q", err, tc.err)
				}
				for _, v := range tc.secrets {
					if strings.Contains(err.Error(), v[10:30]) {
						t.Errorf("error %q holds a secret", err)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := a != nil && a.Host != nil; got != tc.host {
				t.Errorf("host key %v, want %v", got, tc.host)
			}
			if got := a != nil && a.Ctrl != nil; got != tc.ctrl {
				t.Errorf("controller key %v, want %v", got, tc.ctrl)
			}
		})
	}
}

func TestEncodeDHCHAP(t *testing.T) {
	host, ctrl := makeKey(1, 32, 1), makeKey(2, 48, 2)
	a, err := ParseAuth(map[string]string{SecretDHCHAPKey: host, SecretDHCHAPCtrlKey: ctrl})
	if err != nil {
		t.Fatal(err)
	}
	o := validOptions()
	o.DHCHAPSecret, o.DHCHAPCtrlSecret = a.Host, a.Ctrl
	got, err := o.Encode()
	if err != nil {
		t.Fatal(err)
	}
	want := "transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn=nqn.2026-01.io.berth:vol1," +
		"hostnqn=nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e," +
		"hostid=0f8fad5b-d9cb-469f-a165-70867728950e," +
		"dhchap_secret=" + host + ",dhchap_ctrl_secret=" + ctrl
	if got != want {
		t.Errorf("Encode =\n%s\nwant\n%s", got, want)
	}
	// The options print without the keys.
	for _, s := range []string{fmt.Sprintf("%v", o), fmt.Sprintf("%+v", o), fmt.Sprintf("%#v", o)} {
		if strings.Contains(s, host[10:40]) || strings.Contains(s, ctrl[10:40]) {
			t.Errorf("%q prints a key", s)
		}
	}
	// An error in another field holds no key.
	o.NQN = "nqn.bad,nqn"
	if _, err := o.Encode(); err == nil {
		t.Error("Encode accepted a bad NQN")
	} else if strings.Contains(err.Error(), host[10:40]) || strings.Contains(err.Error(), ctrl[10:40]) {
		t.Errorf("error %q holds a key", err)
	}
	// A controller key without a host key is refused.
	o = validOptions()
	o.DHCHAPCtrlSecret = a.Ctrl
	if _, err := o.Encode(); err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Encode with a controller key only: %v", err)
	} else if strings.Contains(err.Error(), ctrl[10:40]) {
		t.Errorf("error %q holds a key", err)
	}
}

// TestParseWithDHCHAPSecrets: the transport takes the keys (it refused
// every dhchap secret before) and refuses bad ones without quoting them.
func TestParseWithDHCHAPSecrets(t *testing.T) {
	tr, err := NewTransport(Options{Host: &HostIdentity{NQN: hostA, ID: hidA}})
	if err != nil {
		t.Fatal(err)
	}
	vc := map[string]string{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"}
	host := makeKey(1, 32, 1)
	tg, err := tr.Parse(vc, map[string]string{SecretDHCHAPKey: host})
	if err != nil {
		t.Fatalf("Parse with a host key: %v", err)
	}
	if tg.auth == nil || tg.auth.Host == nil {
		t.Fatal("the target has no host key")
	}
	_, err = tr.Parse(vc, map[string]string{SecretDHCHAPKey: badCRCKey()})
	if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Parse with a bad key: %v", err)
	}
	if strings.Contains(err.Error(), badCRCKey()[10:40]) {
		t.Errorf("error %q holds the key", err)
	}
}

// authSys is a fake sysfs with controllers of subA at 127.0.0.1:4420
// (nvme1: host key k1; live) and [::1]:4421 (nvme2: host and controller
// keys; reconnecting), and nvme5 of another subsystem on a kernel
// without the key attributes.
func authSys(t *testing.T, k1, k2, c2 string) *sysfstest.Tree {
	sys := sysfstest.New(t)
	sys.Files(map[string]string{
		"class/nvme/nvme1/transport":          "tcp\n",
		"class/nvme/nvme1/subsysnqn":          subA + "\n",
		"class/nvme/nvme1/state":              "live\n",
		"class/nvme/nvme1/hostnqn":            hostA + "\n",
		"class/nvme/nvme1/hostid":             hidA + "\n",
		"class/nvme/nvme1/address":            "traddr=127.0.0.1,trsvcid=4420\n",
		"class/nvme/nvme1/dhchap_secret":      k1 + "\n",
		"class/nvme/nvme1/dhchap_ctrl_secret": "none\n",
		"class/nvme/nvme1/nvme1c1n1/size":     "2048\n",

		"class/nvme/nvme2/transport":          "tcp\n",
		"class/nvme/nvme2/subsysnqn":          subA + "\n",
		"class/nvme/nvme2/state":              "connecting\n",
		"class/nvme/nvme2/hostnqn":            hostA + "\n",
		"class/nvme/nvme2/hostid":             hidA + "\n",
		"class/nvme/nvme2/address":            "traddr=::1,trsvcid=4421\n",
		"class/nvme/nvme2/dhchap_secret":      k2 + "\n",
		"class/nvme/nvme2/dhchap_ctrl_secret": c2 + "\n",
		"class/nvme/nvme2/nvme1c2n1/size":     "2048\n",

		"class/nvme/nvme5/transport": "tcp\n",
		"class/nvme/nvme5/subsysnqn": "nqn.2026-01.io.berth:old\n",
		"class/nvme/nvme5/state":     "live\n",
		"class/nvme/nvme5/hostnqn":   hostA + "\n",
		"class/nvme/nvme5/hostid":    hidA + "\n",
		"class/nvme/nvme5/address":   "traddr=127.0.0.1,trsvcid=4430\n",

		"block/nvme1n1/size":                          "2048\n",
		"block/nvme1n1/nsid":                          "1\n",
		"block/nvme1c1n1/size":                        "2048\n",
		"block/nvme1c2n1/size":                        "2048\n",
		"class/nvme-subsystem/nvme-subsys1/subsysnqn": subA + "\n",
	})
	sys.Link("block/nvme1n1/device", "../../class/nvme-subsystem/nvme-subsys1")
	sys.Link("block/nvme1n1/multipath/nvme1c1n1", "../../nvme1c1n1")
	sys.Link("block/nvme1n1/multipath/nvme1c2n1", "../../nvme1c2n1")
	return sys
}

func TestCheckReuseKeys(t *testing.T) {
	k1, k2, c2 := makeKey(1, 32, 1), makeKey(2, 48, 2), makeKey(3, 64, 3)
	sys := authSys(t, k1, k2, c2)
	tr, err := NewTransport(Options{Sys: sys.Root(), Host: &HostIdentity{NQN: hostA, ID: hidA}})
	if err != nil {
		t.Fatal(err)
	}
	vc := map[string]string{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"}
	for _, tc := range []struct {
		name    string
		ctrl    string
		secrets map[string]string
		want    error
	}{
		{"same host key", "nvme1", map[string]string{SecretDHCHAPKey: k1}, nil},
		{"kernel name of the same key", "nvme1", map[string]string{"dhchap_secret": k1}, nil},
		{"other host key", "nvme1", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrFailedPrecondition},
		{"no key", "nvme1", nil, errdefs.ErrFailedPrecondition},
		{"extra controller key", "nvme1", map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c2}, errdefs.ErrFailedPrecondition},
		{"both keys", "nvme2", map[string]string{SecretDHCHAPKey: k2, SecretDHCHAPCtrlKey: c2}, nil},
		{"controller key missing", "nvme2", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrFailedPrecondition},
		{"other controller key", "nvme2", map[string]string{SecretDHCHAPKey: k2, SecretDHCHAPCtrlKey: k1}, errdefs.ErrFailedPrecondition},
		{"kernel without keys, volume without", "nvme5", nil, nil},
		{"kernel without keys, volume with", "nvme5", map[string]string{SecretDHCHAPKey: k1}, errdefs.ErrUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg, err := tr.Parse(vc, tc.secrets)
			if err != nil {
				t.Fatal(err)
			}
			err = tg.checkReuse(tc.ctrl)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("checkReuse: %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("checkReuse: %v, want %v", err, tc.want)
			}
			t.Log(err)
			for _, k := range []string{k1, k2, c2} {
				if strings.Contains(err.Error(), k[10:30]) {
					t.Errorf("error %q holds a key", err)
				}
			}
		})
	}
	// A kernel whose controllers lack the attributes refuses keys before
	// connecting.
	tg, _ := tr.Parse(vc, map[string]string{SecretDHCHAPKey: k1})
	ctrls, err := sysTree{root: sys.Root()}.readControllers("")
	if err != nil {
		t.Fatal(err)
	}
	if err := tg.checkKernelAuth(ctrls); err != nil {
		t.Errorf("checkKernelAuth with nvme1 showing keys: %v", err)
	}
	if err := tg.checkKernelAuth(ctrls[2:]); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Errorf("checkKernelAuth with nvme5 only: %v", err)
	}
}

// TestHealthNamesAuthentication: a controller that reconnects and was
// connected with a DH-HMAC-CHAP key says that a changed key on the
// target is a reason; the key itself appears nowhere.
func TestHealthNamesAuthentication(t *testing.T) {
	k1, k2, c2 := makeKey(1, 32, 1), makeKey(2, 48, 2), makeKey(3, 64, 3)
	sys := authSys(t, k1, k2, c2)
	tr, err := NewTransport(Options{Sys: sys.Root(), Host: &HostIdentity{NQN: hostA, ID: hidA}})
	if err != nil {
		t.Fatal(err)
	}
	tg, err := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "targets": "127.0.0.1:4420,[::1]:4421"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	abnormal, msg := tg.Health(context.Background())
	t.Log(msg)
	if !abnormal || !strings.Contains(msg, "nvme2") || !strings.Contains(msg, "DH-HMAC-CHAP") {
		t.Errorf("Health = %v, %q: want the reconnecting path to name DH-HMAC-CHAP", abnormal, msg)
	}
	if i := strings.Index(msg, "(nvme1)"); i >= 0 && strings.Contains(msg[i:strings.Index(msg, ";")], "DH-HMAC-CHAP") {
		t.Errorf("Health %q: the live path need not mention authentication", msg)
	}
	for _, k := range []string{k1, k2, c2} {
		if strings.Contains(msg, k[10:30]) {
			t.Errorf("Health %q holds a key", msg)
		}
	}
}
