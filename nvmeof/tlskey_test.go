package nvmeof

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

// tlsKeyText builds an interchange-format PSK of key with hash id hh,
// CRC-32 (IEEE) of the key appended little endian.
func tlsKeyText(hh string, key []byte) string {
	b := append([]byte(nil), key...)
	b = binary.LittleEndian.AppendUint32(b, crc32.ChecksumIEEE(key))
	return "NVMeTLSkey-1:" + hh + ":" + base64.StdEncoding.EncodeToString(b) + ":"
}

func seqKey(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

func TestParseTLSKey(t *testing.T) {
	// Printed by nvme-cli: 2.3 (Debian 12) gen-tls-key --hmac=1 and
	// --hmac=2, and 2.13 (Debian 13) gen-tls-key --hmac=1
	// --secret=000102...1f.
	for _, s := range []string{
		"NVMeTLSkey-1:01:Hth4kUVYRgYg4rp0U8Xw31R24QOv7L0QBquCaMYOudj9MfE/:",
		"NVMeTLSkey-1:02:68jShgL+4rQJa1YYl/AFdeIob/fCGkklxozxudtUxtpq8eYc6uD7DQgg6cRHki/a2oJ9bA==:",
		"NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
		tlsKeyText("01", seqKey(32)),
		tlsKeyText("02", seqKey(48)),
		tlsKeyText("00", seqKey(32)),
		tlsKeyText("00", seqKey(48)),
	} {
		k, err := ParseTLSKey(SecretTLSKey, s)
		if err != nil {
			t.Errorf("ParseTLSKey(%q): %v", s, err)
			continue
		}
		for _, out := range []string{k.String(), fmt.Sprintf("%v %+v %s %x %q", k, *k, k, *k, *k)} {
			if strings.Contains(out, s[16:30]) {
				t.Errorf("the key prints its secret: %s", out)
			}
		}
	}
	if got := tlsKeyText("01", seqKey(32)); got != "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:" {
		t.Errorf("the CRC differs from nvme-cli's: %s", got)
	}

	good := tlsKeyText("01", seqKey(32))
	crcBad := []byte(good)
	crcBad[20] ^= 1
	for _, c := range []struct{ name, s, why string }{
		{"empty", "", "empty"},
		{"DH-HMAC-CHAP key", "DHHC-1:01:" + good[16:], "NVMeTLSkey-1:"},
		{"version 2", "NVMeTLSkey-2:01:" + good[16:], "NVMeTLSkey-1:"},
		{"hash 03", "NVMeTLSkey-1:03:" + good[16:], "unknown hash"},
		{"hash 1", "NVMeTLSkey-1:1:" + good[16:], "two digits"},
		{"no closing colon", strings.TrimSuffix(good, ":"), "single colon"},
		{"two closing colons", good + ":", "single colon"},
		{"not base64", "NVMeTLSkey-1:01:!!!!:", "base64"},
		{"unpadded", strings.TrimSuffix(tlsKeyText("02", seqKey(48)), "==:") + ":", "base64"},
		{"SHA-256 with 48 bytes", tlsKeyText("01", seqKey(48)), "wrong length"},
		{"SHA-384 with 32 bytes", tlsKeyText("02", seqKey(32)), "wrong length"},
		{"64 bytes", tlsKeyText("00", seqKey(64)), "wrong length"},
		{"16 bytes", tlsKeyText("01", seqKey(16)), "wrong length"},
		{"CRC", string(crcBad), ""},
	} {
		_, err := ParseTLSKey(SecretTLSKey, c.s)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.why) {
			t.Errorf("%s: %v, want InvalidArgument with %q", c.name, err, c.why)
			continue
		}
		if c.s != "" && len(c.s) > 30 && strings.Contains(err.Error(), c.s[16:30]) {
			t.Errorf("%s: the error quotes the key: %v", c.name, err)
		}
	}
}

func TestTLSIdentity(t *testing.T) {
	host := "nqn.2014-08.org.nvmexpress:uuid:b2428a38-9580-4517-ad24-e8c8149c989d"
	sub := "nqn.2026-01.io.berth:tls"
	for _, c := range []struct {
		hh   string
		size int
		want string
	}{
		{"01", 32, "NVMe0R01 " + host + " " + sub},
		{"02", 48, "NVMe0R02 " + host + " " + sub},
		{"00", 32, "NVMe0R01 " + host + " " + sub},
		{"00", 48, "NVMe0R02 " + host + " " + sub},
	} {
		k, err := ParseTLSKey(SecretTLSKey, tlsKeyText(c.hh, seqKey(c.size)))
		if err != nil {
			t.Fatal(err)
		}
		if got := k.TLSIdentity(host, sub); got != c.want {
			t.Errorf("hash %s, %d bytes: identity %q, want %q", c.hh, c.size, got, c.want)
		}
	}
}

// The PSKs nvme-cli 2.13 (libnvme 1.13, Debian 13) inserted into the
// .nvme keyring with check-tls-key --insert for these keys, host and
// subsystem, read back in TestTLSGuest/OperatorKey.
var deriveVectors = []struct {
	key, host, sub, psk string
}{
	{"NVMeTLSkey-1:01:Ys2DvDmWGPsFy5f+G5pX5QZst4hyw8TPDFrkSy4ht6hUctWA:", "nqn.2014-08.org.nvmexpress:uuid:5d2a7e1c-0b7e-4f0e-9a51-2c7c3b0f8e01", "nqn.2026-01.io.berth:tls",
		"7534181a1a49caee622c8dd8f39154e3edb68df905b4ffb72c2e4e4b033b60dc"},
	{"NVMeTLSkey-1:01:Ys2DvDmWGPsFy5f+G5pX5QZst4hyw8TPDFrkSy4ht6hUctWA:", "nqn.2026-01.io.berth:host-x", "nqn.2026-01.io.berth:tls",
		"c294e3a64088271b4ad4b773d0e70473174276a8d05a2a90fb0d77a5f1f2ec26"},
	{"NVMeTLSkey-1:02:pST5typ7o5o3MAothgY8BaFbqLbzvxFinDF2c1oSHQYPnmgqHWpw720W0gzSp+4rGD4m4g==:", "nqn.2014-08.org.nvmexpress:uuid:5d2a7e1c-0b7e-4f0e-9a51-2c7c3b0f8e01", "nqn.2026-01.io.berth:tls",
		"cd03df5525241279d4e83356ca215bc2f830f8a26dd8e5b264e96d3ac6bcf1c8f44cc1e902e8213f6677a6953f16cb4c"},
	{"NVMeTLSkey-1:02:pST5typ7o5o3MAothgY8BaFbqLbzvxFinDF2c1oSHQYPnmgqHWpw720W0gzSp+4rGD4m4g==:", "nqn.2026-01.io.berth:host-x", "nqn.2026-01.io.berth:tls",
		"57659dfd651f71bd59a19ba65b5244d86706a68b3e15a4ad040570a0eee501b46a2a7724b8cbd11f1ddb989f51240419"},
}

func TestTLSDerive(t *testing.T) {
	if len(deriveVectors) == 0 {
		t.Fatal("no vectors")
	}
	for _, v := range deriveVectors {
		k, err := ParseTLSKey(SecretTLSKey, v.key)
		if err != nil {
			t.Fatal(err)
		}
		psk, err := k.Derive(v.host, v.sub)
		if err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprintf("%x", psk); got != v.psk {
			t.Errorf("Derive(%s, %s) = %s, nvme-cli inserted %s", v.host, v.sub, got, v.psk)
		}
	}
	// Other NQNs, other keys, and the hash make other PSKs; the
	// length follows the key.
	k1, _ := ParseTLSKey(SecretTLSKey, tlsKeyText("01", seqKey(32)))
	k0, _ := ParseTLSKey(SecretTLSKey, tlsKeyText("00", seqKey(32)))
	k2, _ := ParseTLSKey(SecretTLSKey, tlsKeyText("02", seqKey(48)))
	a, _ := k1.Derive("nqn.2026-01.io.berth:h1", "nqn.2026-01.io.berth:s")
	b, _ := k1.Derive("nqn.2026-01.io.berth:h2", "nqn.2026-01.io.berth:s")
	c, _ := k1.Derive("nqn.2026-01.io.berth:h1", "nqn.2026-01.io.berth:s2")
	d, _ := k0.Derive("nqn.2026-01.io.berth:h1", "nqn.2026-01.io.berth:s")
	e, _ := k2.Derive("nqn.2026-01.io.berth:h1", "nqn.2026-01.io.berth:s")
	if len(a) != 32 || len(e) != 48 {
		t.Errorf("PSK lengths %d, %d; want 32, 48", len(a), len(e))
	}
	for i, x := range [][]byte{b, c, d} {
		if bytes.Equal(a, x) {
			t.Errorf("case %d: the same PSK for another host, subsystem or hash", i)
		}
	}
	if bytes.Equal(a, seqKey(32)) || bytes.Equal(d, seqKey(32)) {
		t.Error("the PSK is the configured key")
	}
}

func TestParseTLS(t *testing.T) {
	base := map[string]string{"nqn": "nqn.2026-01.io.berth:s", "nsid": "1", "traddr": "10.0.0.5"}
	with := func(kv ...string) map[string]string {
		m := map[string]string{}
		for k, v := range base {
			m[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	key := tlsKeyText("01", seqKey(32))
	ok := []struct {
		vc      map[string]string
		secrets map[string]string
		tls     bool
		name    string
		hasKey  bool
	}{
		{base, nil, false, "", false},
		{with("tls", "false"), nil, false, "", false},
		{with("tls", "true"), nil, true, "", false},
		{with("tls", "true"), map[string]string{SecretTLSKey: key}, true, "", true},
		{with("tls", "true", "tlsKeyName", "NVMe0R01 nqn.2026-01.io.berth:h nqn.2026-01.io.berth:s"), nil, true, "NVMe0R01 nqn.2026-01.io.berth:h nqn.2026-01.io.berth:s", false},
		{with("tls", "true", "tlsKeyName", "861825738"), nil, true, "861825738", false},
	}
	for i, c := range ok {
		v, err := ParseVolumeContext(c.vc)
		if err != nil {
			t.Errorf("case %d: %v", i, err)
			continue
		}
		k, err := ParseTLSSecret(v, c.secrets)
		if err != nil || v.TLS != c.tls || v.TLSKeyName != c.name || (k != nil) != c.hasKey {
			t.Errorf("case %d: TLS %v name %q key %v, %v", i, v.TLS, v.TLSKeyName, k, err)
		}
	}
	for _, c := range []struct {
		vc     map[string]string
		concat bool
	}{{with("tls", "true", "tlsConcat", "true"), true}, {with("tls", "true", "tlsConcat", "false"), false}} {
		v, err := ParseVolumeContext(c.vc)
		if err != nil || !v.TLS || v.TLSConcat != c.concat {
			t.Errorf("%v: TLS %v concat %v, %v", c.vc, v != nil && v.TLS, v != nil && v.TLSConcat, err)
		}
	}
	bad := []struct {
		vc      map[string]string
		secrets map[string]string
		why     string
	}{
		{with("tls", "yes"), nil, "want"},
		{with("tlsKeyName", "x"), nil, "does not ask for TLS"},
		{base, map[string]string{SecretTLSKey: key}, "does not ask for TLS"},
		{with("tls", "true", "tlsKeyName", "x"), map[string]string{SecretTLSKey: key}, "not both"},
		{with("tls", "true", "tlsKeyName", ""), nil, "description or serial"},
		{with("tls", "true", "tlsKeyName", "a,b"), nil, "commas"},
		{with("tls", "true", "tlsKeyName", "-5"), nil, "positive"},
		{with("tls", "true"), map[string]string{"tls_key": key}, "unknown TLS secret"},
		{with("tls", "true"), map[string]string{"TLSKey": key}, "unknown TLS secret"},
		{with("tls", "true"), map[string]string{SecretTLSKey: "NVMeTLSkey-1:01:x:"}, "interchange format"},
		{with("tls", "true", "trtype", "rdma"), nil, "tcp transport"},
		{with("tlsConcat", "true"), nil, "does not ask for TLS"},
		{with("tls", "true", "tlsConcat", "yes"), nil, "want"},
		{with("tls", "true", "tlsConcat", "true", "tlsKeyName", "x"), nil, "name no key"},
		{with("tls", "true", "tlsConcat", "true"), map[string]string{SecretTLSKey: key}, "give no PSK"},
	}
	for i, c := range bad {
		v, err := ParseVolumeContext(c.vc)
		if err == nil {
			_, err = ParseTLSSecret(v, c.secrets)
		}
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.why) {
			t.Errorf("case %d: %v, want InvalidArgument with %q", i, err, c.why)
		}
		if err != nil && strings.Contains(err.Error(), key[16:30]) {
			t.Errorf("case %d: the error quotes the key: %v", i, err)
		}
	}
}

func TestEncodeTLS(t *testing.T) {
	o := ConnectOptions{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", TLS: true, TLSKey: 0x334e6aca, Keyring: 12}
	s, err := o.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if want := "transport=tcp,traddr=10.0.0.5,trsvcid=4420,nqn=nqn.2026-01.io.berth:s,tls,keyring=12,tls_key=860777162"; s != want {
		t.Errorf("Encode = %q, want %q", s, want)
	}
	o = ConnectOptions{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", TLS: true}
	if s, _ := o.Encode(); !strings.HasSuffix(s, ",tls") {
		t.Errorf("Encode = %q, want a final tls flag", s)
	}
	chap, err := ParseDHCHAPKey(SecretDHCHAPKey, testSecret("DHHC-1:00:", "concat", 32))
	if err != nil {
		t.Fatal(err)
	}
	o = ConnectOptions{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", Concat: true, DHCHAPSecret: chap}
	if s, err := o.Encode(); err != nil || !strings.HasPrefix(s, "transport=tcp,traddr=10.0.0.5,trsvcid=4420,nqn=nqn.2026-01.io.berth:s,concat,dhchap_secret=DHHC-1:00:") {
		t.Errorf("Encode = %q, %v, want concat and the DH-HMAC-CHAP key", s, err)
	}
	for _, o := range []ConnectOptions{
		{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", Concat: true},
		{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", Concat: true, TLS: true, DHCHAPSecret: chap},
		{Transport: "rdma", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", Concat: true, DHCHAPSecret: chap},
		{Transport: "rdma", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", TLS: true},
		{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", TLSKey: 5},
		{Transport: "tcp", TrAddr: "10.0.0.5", NQN: "nqn.2026-01.io.berth:s", TLS: true, Keyring: -1},
	} {
		if _, err := o.Encode(); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Encode(%+v): %v, want InvalidArgument", o, err)
		}
	}
}

func TestReadTLSKey(t *testing.T) {
	files := map[string]string{
		"/sys/class/nvme/nvme0/tls_key": "334e6aca\n",
		"/sys/class/nvme/nvme2/tls_key": "bogus\n",
	}
	s := sysTree{readFile: func(name string) ([]byte, error) {
		if v, ok := files[name]; ok {
			return []byte(v), nil
		}
		return nil, fs.ErrNotExist
	}}
	if got, err := s.readTLSKey("nvme0"); got != 0x334e6aca || err != nil {
		t.Errorf("nvme0: %x, %v", got, err)
	}
	if got, err := s.readTLSKey("nvme1"); got != 0 || err != nil {
		t.Errorf("nvme1 (no TLS): %x, %v", got, err)
	}
	if _, err := s.readTLSKey("nvme2"); err == nil {
		t.Error("nvme2: no error for a bad serial")
	}
}

// The option lists of /dev/nvme-fabrics measured on Debian 13's 6.12
// (with TLS), Debian 13 backports' 7.3.4 (with concat too) and Debian
// 12's 6.1.0-57 (without; it lists dhchap_secret all the same, though
// built without in-band authentication).
const (
	fabricsOpts612   = "instance=-1,cntlid=-1,transport=%s,traddr=%s,trsvcid=%s,nqn=%s,queue_size=%d,nr_io_queues=%d,reconnect_delay=%d,ctrl_loss_tmo=%d,keep_alive_tmo=%d,hostnqn=%s,host_traddr=%s,host_iface=%s,hostid=%s,duplicate_connect,disable_sqflow,hdr_digest,data_digest,nr_write_queues=%d,nr_poll_queues=%d,tos=%d,keyring=%d,tls_key=%d,fast_io_fail_tmo=%d,discovery,dhchap_secret=%s,dhchap_ctrl_secret=%s,tls\n"
	fabricsOpts73    = "instance=-1,cntlid=-1,transport=%s,traddr=%s,trsvcid=%s,nqn=%s,queue_size=%d,nr_io_queues=%d,reconnect_delay=%d,ctrl_loss_tmo=%d,keep_alive_tmo=%d,hostnqn=%s,host_traddr=%s,host_iface=%s,hostid=%s,duplicate_connect,disable_sqflow,hdr_digest,data_digest,nr_write_queues=%d,nr_poll_queues=%d,tos=%d,keyring=%d,tls_key=%d,fast_io_fail_tmo=%d,discovery,dhchap_secret=%s,dhchap_ctrl_secret=%s,tls,concat\n"
	fabricsOptsNoTLS = "instance=-1,cntlid=-1,transport=%s,traddr=%s,trsvcid=%s,nqn=%s,queue_size=%d,nr_io_queues=%d,reconnect_delay=%d,ctrl_loss_tmo=%d,keep_alive_tmo=%d,hostnqn=%s,host_traddr=%s,host_iface=%s,hostid=%s,duplicate_connect,disable_sqflow,hdr_digest,data_digest,nr_write_queues=%d,nr_poll_queues=%d,tos=%d,fast_io_fail_tmo=%d,discovery,dhchap_secret=%s,dhchap_ctrl_secret=%s\n"
)

func TestTLSSupported(t *testing.T) {
	for _, c := range []struct {
		opts   string
		concat bool
		want   error
		says   string
	}{
		{fabricsOpts612, false, nil, ""},
		{fabricsOpts73, false, nil, ""},
		{fabricsOpts73, true, nil, ""},
		{fabricsOpts612, true, errdefs.ErrUnsupported, "Linux 6.15"},
		{fabricsOptsNoTLS, false, errdefs.ErrUnsupported, "CONFIG_NVME_TCP_TLS"},
		{fabricsOptsNoTLS, true, errdefs.ErrUnsupported, "CONFIG_NVME_TCP_TLS"},
	} {
		dev := filepath.Join(t.TempDir(), "nvme-fabrics")
		if err := os.WriteFile(dev, []byte(c.opts), 0o600); err != nil {
			t.Fatal(err)
		}
		tr, err := NewTransport(Options{FabricsDevice: dev})
		if err != nil {
			t.Fatal(err)
		}
		err = tr.tlsSupported(c.concat)
		if c.want == nil && err != nil || c.want != nil && (!errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says)) {
			t.Errorf("tlsSupported(concat %v) with %.40q...: %v, want %v saying %q", c.concat, c.opts[len(c.opts)-20:], err, c.want, c.says)
		}
	}
}
