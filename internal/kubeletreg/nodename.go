package kubeletreg

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// clientCert is the kubelet's current client certificate below its root
// directory (TLS bootstrap and certificate rotation keep it there).
const clientCert = "pki/kubelet-client-current.pem"

// NodeName returns the name the kubelet under kubeletDir registered its
// node as: the API server knows a kubelet by the subject of its client
// certificate, CN=system:node:NAME.
func NodeName(kubeletDir string) (string, error) {
	p := filepath.Join(kubeletDir, clientCert)
	data, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("read the kubelet's client certificate: %w", err)
	}
	return nodeNameFromPEM(p, data)
}

func nodeNameFromPEM(p string, data []byte) (string, error) {
	for {
		var b *pem.Block
		if b, data = pem.Decode(data); b == nil {
			return "", fmt.Errorf("kubelet client certificate %s: no certificate", p)
		}
		if b.Type != "CERTIFICATE" {
			continue // the private key, in the same file
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return "", fmt.Errorf("kubelet client certificate %s: %w", p, err)
		}
		name, ok := strings.CutPrefix(c.Subject.CommonName, "system:node:")
		if !ok || name == "" {
			return "", fmt.Errorf("kubelet client certificate %s: subject %q is not system:node:NAME", p, c.Subject.CommonName)
		}
		return name, nil
	}
}
