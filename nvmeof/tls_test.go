package nvmeof

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/keyring"
)

// A kernel with NVMe/TCP TLS whose .nvme keyring is missing (the
// nvme_keyring module not loaded): the stage fails before any connect
// with ErrUnsupported, which the agent answers FAILED_PRECONDITION, and
// the message says what to load.
func TestPrepareTLSWithoutNVMeKeyring(t *testing.T) {
	dev := filepath.Join(t.TempDir(), "nvme-fabrics")
	if err := os.WriteFile(dev, []byte(fabricsOpts612), 0o600); err != nil {
		t.Fatal(err)
	}
	host := HostIdentity{NQN: "nqn.2014-08.org.nvmexpress:uuid:5d2a7e1c-0b7e-4f0e-9a51-2c7c3b0f8e01", ID: "5d2a7e1c-0b7e-4f0e-9a51-2c7c3b0f8e01"}
	tr, err := NewTransport(Options{FabricsDevice: dev, Host: &host, listKeys: func() ([]keyring.Key, error) {
		return []keyring.Key{{Serial: 0x1234, Type: "keyring", Description: ".builtin_trusted_keys"}}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	for _, secrets := range []map[string]string{{SecretTLSKey: tlsKeyText("01", seqKey(32))}, nil} {
		tg, err := tr.Parse(map[string]string{"nqn": "nqn.2026-01.io.berth:tls", "nsid": "1", "traddr": "10.0.0.5", "tls": "true"}, secrets)
		if err != nil {
			t.Fatal(err)
		}
		_, err = tg.prepareTLS(context.Background(), host, nil)
		if !errors.Is(err, errdefs.ErrUnsupported) || !strings.Contains(err.Error(), "no .nvme keyring") || !strings.Contains(err.Error(), "modprobe nvme-tcp") {
			t.Errorf("prepareTLS without .nvme: %v, want ErrUnsupported (FAILED_PRECONDITION) saying to load nvme-tcp", err)
		}
	}
}

func TestGeneratedPSK(t *testing.T) {
	host, sub := "nqn.2014-08.org.nvmexpress:uuid:7f4c9a3e-2d9f-4b2a-9c73-4e9e5d2a0a23", "nqn.2026-01.io.berth:tls-concat"
	for _, c := range []struct {
		desc      string
		generated bool
		forVolume bool
	}{
		// Measured on 7.3.4.
		{"NVMe1G01 " + host + " " + sub + " tV28PYRnw8U3CK1bjF7dQ7gRfhEoI3lesVnqNbzvuYg=", true, true},
		{"NVMe1G02 " + host + " " + sub + " x", true, true},
		{"NVMe1G01 " + host + " nqn.2026-01.io.berth:other x", true, false},
		{"NVMe0R01 " + host + " " + sub, false, false},
		{"NVMe1R01 " + host + " " + sub + " x", false, false},
		{"NVMe", false, false},
		{"", false, false},
	} {
		if got := generatedPSK(c.desc); got != c.generated {
			t.Errorf("generatedPSK(%q) = %v", c.desc, got)
		}
		if got := generatedPSKFor(c.desc, host, sub); got != c.forVolume {
			t.Errorf("generatedPSKFor(%q) = %v", c.desc, got)
		}
	}
}

// A volume with concatenation: the DH-HMAC-CHAP host key is required
// (INVALID_ARGUMENT before anything is connected), no PSK is prepared,
// and only a controller encrypted with a PSK the kernel generated is
// reused.
func TestPrepareTLSConcat(t *testing.T) {
	dev := filepath.Join(t.TempDir(), "nvme-fabrics")
	if err := os.WriteFile(dev, []byte(fabricsOpts73), 0o600); err != nil {
		t.Fatal(err)
	}
	host := HostIdentity{NQN: "nqn.2014-08.org.nvmexpress:uuid:7f4c9a3e-2d9f-4b2a-9c73-4e9e5d2a0a23", ID: "7f4c9a3e-2d9f-4b2a-9c73-4e9e5d2a0a23"}
	sub := "nqn.2026-01.io.berth:tls-concat"
	keys := []keyring.Key{
		{Serial: 0x01ae9a16, Type: "keyring", Description: ".nvme"},
		{Serial: 0x1408d676, Type: "psk", Description: "NVMe1G01 " + host.NQN + " " + sub + " tV28PYRnw8U3CK1bjF7dQ7gRfhEoI3lesVnqNbzvuYg="},
		{Serial: 0x334e6aca, Type: "psk", Description: "NVMe0R01 " + host.NQN + " " + sub},
	}
	files := map[string]string{
		"/sys/class/nvme/nvme0/tls_key": "1408d676\n", // concatenation
		"/sys/class/nvme/nvme1/tls_key": "334e6aca\n", // a configured PSK
		// nvme2: no TLS
	}
	tr, err := NewTransport(Options{FabricsDevice: dev, Host: &host,
		listKeys: func() ([]keyring.Key, error) { return keys, nil },
		readFile: func(name string) ([]byte, error) {
			if v, ok := files[name]; ok {
				return []byte(v), nil
			}
			return nil, fs.ErrNotExist
		}})
	if err != nil {
		t.Fatal(err)
	}
	vc := map[string]string{"nqn": sub, "nsid": "1", "traddr": "10.0.0.5", "tls": "true", "tlsConcat": "true"}
	tg, err := tr.Parse(vc, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tg.prepareTLS(context.Background(), host, nil); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), SecretDHCHAPKey) {
		t.Errorf("prepareTLS without a DH-HMAC-CHAP key: %v, want InvalidArgument naming %q", err, SecretDHCHAPKey)
	}
	tg, err = tr.Parse(vc, map[string]string{SecretDHCHAPKey: testSecret("DHHC-1:00:", "concat", 32)})
	if err != nil {
		t.Fatal(err)
	}
	c, err := tg.prepareTLS(context.Background(), host, nil)
	if err != nil || !c.concat || c.key != 0 || c.inserted {
		t.Fatalf("prepareTLS: %+v, %v, want concatenation and no key", c, err)
	}
	if err := tg.checkTLSReuse("nvme0", c); err != nil {
		t.Errorf("controller with a generated PSK: %v", err)
	}
	for ctrl, says := range map[string]string{"nvme1": "configured TLS PSK (key 334e6aca)", "nvme2": "without TLS"} {
		if err := tg.checkTLSReuse(ctrl, c); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), says) || !strings.Contains(err.Error(), ctrl) {
			t.Errorf("%s: %v, want FailedPrecondition naming it and saying %q", ctrl, err, says)
		}
	}
}

// A connect interface that could not be read (the module not loaded
// yet) is read again at the next TLS stage: the failure is not kept
// until berth restarts.
func TestTLSSupportedReadsAgainAfterFailure(t *testing.T) {
	dev := filepath.Join(t.TempDir(), "nvme-fabrics")
	tr, err := NewTransport(Options{FabricsDevice: dev})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.tlsSupported(false); err == nil {
		t.Fatal("tlsSupported without the fabrics device: no error")
	}
	if err := os.WriteFile(dev, []byte(fabricsOpts73), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := tr.tlsSupported(true); err != nil {
		t.Errorf("tlsSupported once the fabrics device is there: %v", err)
	}
	if err := os.Remove(dev); err != nil {
		t.Fatal(err)
	}
	if err := tr.tlsSupported(true); err != nil {
		t.Errorf("tlsSupported after a successful read: %v, want the options read before", err)
	}
}
