package kubeletreg

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// certPEM is a self-signed certificate with the subject cn, after a
// private key block, as the kubelet writes kubelet-client-current.pem.
func certPEM(t *testing.T, cn string) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn, Organization: []string{"system:nodes"}},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return append(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
}

func TestNodeName(t *testing.T) {
	dir := t.TempDir()
	if _, err := NodeName(dir); err == nil {
		t.Fatal("no certificate: want an error")
	}
	if err := os.MkdirAll(filepath.Join(dir, "pki"), 0o700); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, clientCert)
	for cn, want := range map[string]string{"system:node:worker-1": "worker-1", "admin": "", "system:node:": ""} {
		if err := os.WriteFile(p, certPEM(t, cn), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := NodeName(dir)
		if got != want || (want == "") != (err != nil) {
			t.Errorf("subject %q: got %q, %v; want %q", cn, got, err, want)
		}
	}
	if err := os.WriteFile(p, []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := NodeName(dir); err == nil {
		t.Error("not PEM: want an error")
	}
}
