package nvmeof

import (
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Secret keys of NVMe in-band authentication (DH-HMAC-CHAP, NVMe base
// specification 8.13). The names are the kernel's connect options
// (dhchap_secret, dhchap_ctrl_secret) in the camel case of berth's
// volume_context keys; the kernel's own spelling is accepted too.
const (
	// SecretDHCHAPKey is the host's key: the target authenticates the
	// host with it.
	SecretDHCHAPKey = "dhchapSecret"
	// SecretDHCHAPCtrlKey is the controller's key: with it the host
	// also authenticates the target (bidirectional authentication). It
	// needs SecretDHCHAPKey.
	SecretDHCHAPCtrlKey = "dhchapCtrlSecret"

	aliasDHCHAPKey     = "dhchap_secret"
	aliasDHCHAPCtrlKey = "dhchap_ctrl_secret"
)

// DHCHAP hash identifiers of the DHHC-1 representation: the hash that
// transforms the key before use (NVMe base specification 8.13.5.8).
const (
	DHCHAPHashNone   = 0
	DHCHAPHashSHA256 = 1
	DHCHAPHashSHA384 = 2
	DHCHAPHashSHA512 = 3
)

const dhchapPrefix = "DHHC-1:"

// DHCHAPKey is a validated DH-HMAC-CHAP secret in the representation
// nvme-cli's gen-dhchap-key prints and the kernel takes:
//
//	DHHC-1:<hh>:<base64 of the key and its CRC-32>:
//
// It prints as its hash and size only; the secret leaves it only
// through the connect string (ConnectOptions.Encode) and the constant
// time comparison with a controller's key.
type DHCHAPKey struct {
	text string // the whole representation, as given
	hash int
	size int
}

// ParseDHCHAPKey validates a DHHC-1 secret: the version prefix, a hash
// id of 00 (none), 01 (SHA-256), 02 (SHA-384) or 03 (SHA-512), a
// base64 payload of a 32, 48 or 64 byte key followed by the CRC-32
// (IEEE, little endian) of the key, and the closing colon. field names
// the secret in errors, which never quote the value.
func ParseDHCHAPKey(field, s string) (*DHCHAPKey, error) {
	bad := func(why string) error {
		return errdefs.InvalidArgument("secret %q: not a DH-HMAC-CHAP key in the DHHC-1:<hash>:<base64>: form nvme gen-dhchap-key prints: %s", field, why)
	}
	if s == "" {
		return nil, bad("empty")
	}
	rest, ok := strings.CutPrefix(s, dhchapPrefix)
	if !ok {
		return nil, bad("it does not start with DHHC-1:")
	}
	if len(rest) < 3 || rest[2] != ':' {
		return nil, bad("the hash id is not two digits")
	}
	var hash int
	switch rest[:2] {
	case "00":
		hash = DHCHAPHashNone
	case "01":
		hash = DHCHAPHashSHA256
	case "02":
		hash = DHCHAPHashSHA384
	case "03":
		hash = DHCHAPHashSHA512
	default:
		return nil, bad("unknown hash id, want 00 (none), 01 (SHA-256), 02 (SHA-384) or 03 (SHA-512)")
	}
	payload, ok := strings.CutSuffix(rest[3:], ":")
	if !ok || strings.Contains(payload, ":") {
		return nil, bad("it does not end with a single colon after the base64 key")
	}
	enc := base64.StdEncoding
	if !strings.HasSuffix(payload, "=") {
		enc = base64.RawStdEncoding
		if len(payload)%4 == 0 {
			enc = base64.StdEncoding
		}
	}
	b, err := enc.Strict().DecodeString(payload)
	if err != nil {
		return nil, bad("the key is not valid base64")
	}
	size := len(b) - 4
	switch size {
	case 32, 48, 64:
	default:
		return nil, bad(fmt.Sprintf("wrong length: %d bytes decoded, want a 32, 48 or 64 byte key and its 4 byte CRC", len(b)))
	}
	if crc32.ChecksumIEEE(b[:size]) != binary.LittleEndian.Uint32(b[size:]) {
		return nil, bad("the CRC does not match the key (a copy and paste error?)")
	}
	return &DHCHAPKey{text: s, hash: hash, size: size}, nil
}

// Hash is the key's hash id (DHCHAPHashNone...).
func (k *DHCHAPKey) Hash() int { return k.hash }

// Size is the key's length in bytes: 32, 48 or 64.
func (k *DHCHAPKey) Size() int { return k.size }

// String describes the key without its secret.
func (k *DHCHAPKey) String() string {
	if k == nil {
		return "none"
	}
	return fmt.Sprintf("DHHC-1:%02d:<%d byte key>:", k.hash, k.size)
}

// Format prints String for every verb, so that no verb (%+v of a struct
// holding the key by value, %x, %q) prints the secret.
func (k DHCHAPKey) Format(f fmt.State, _ rune) { fmt.Fprint(f, (&k).String()) }

// equalText compares the key with a controller's key attribute in
// constant time.
func (k *DHCHAPKey) equalText(s string) bool {
	return subtle.ConstantTimeCompare([]byte(k.text), []byte(s)) == 1
}

// Auth is the DH-HMAC-CHAP configuration of a volume: a host key, and
// for bidirectional authentication a controller key. A nil *Auth is no
// authentication.
type Auth struct {
	Host *DHCHAPKey
	Ctrl *DHCHAPKey // nil: the host does not authenticate the controller
}

// String describes the configuration without the secrets.
func (a *Auth) String() string {
	switch {
	case a == nil || a.Host == nil:
		return "no DH-HMAC-CHAP key"
	case a.Ctrl == nil:
		return "DH-HMAC-CHAP host key"
	}
	return "DH-HMAC-CHAP host and controller keys"
}

// ParseAuth takes the DH-HMAC-CHAP keys out of a request's secrets:
// SecretDHCHAPKey (or dhchap_secret) and SecretDHCHAPCtrlKey (or
// dhchap_ctrl_secret). Other secrets are ignored, but one whose name
// mentions dhchap and is none of these is refused: a misspelt key would
// otherwise connect without authentication. It returns nil without keys.
func ParseAuth(secrets map[string]string) (*Auth, error) {
	for k := range secrets {
		switch k {
		case SecretDHCHAPKey, SecretDHCHAPCtrlKey, aliasDHCHAPKey, aliasDHCHAPCtrlKey:
		default:
			if strings.Contains(strings.ToLower(k), "dhchap") {
				return nil, errdefs.InvalidArgument("secret %q: unknown DH-HMAC-CHAP key name; the keys are %q (host key) and %q (controller key, for bidirectional authentication)", k, SecretDHCHAPKey, SecretDHCHAPCtrlKey)
			}
		}
	}
	get := func(key, alias string) (*DHCHAPKey, error) {
		v, ok := secrets[key]
		name := key
		if av, aok := secrets[alias]; aok {
			if ok && av != v {
				return nil, errdefs.InvalidArgument("secrets %q and %q disagree", key, alias)
			}
			v, ok, name = av, true, alias
		}
		if !ok {
			return nil, nil
		}
		return ParseDHCHAPKey(name, v)
	}
	host, err := get(SecretDHCHAPKey, aliasDHCHAPKey)
	if err != nil {
		return nil, err
	}
	ctrl, err := get(SecretDHCHAPCtrlKey, aliasDHCHAPCtrlKey)
	if err != nil {
		return nil, err
	}
	switch {
	case host == nil && ctrl == nil:
		return nil, nil
	case host == nil:
		return nil, errdefs.InvalidArgument("secret %q: the controller key needs a host key in %q (bidirectional authentication authenticates the host first)", SecretDHCHAPCtrlKey, SecretDHCHAPKey)
	case ctrl != nil && ctrl.equalText(host.text):
		return nil, errdefs.InvalidArgument("secrets %q and %q: the host and controller keys are the same; bidirectional authentication needs two different keys", SecretDHCHAPKey, SecretDHCHAPCtrlKey)
	}
	return &Auth{Host: host, Ctrl: ctrl}, nil
}
