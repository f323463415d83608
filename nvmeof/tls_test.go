package nvmeof

import (
	"context"
	"errors"
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
