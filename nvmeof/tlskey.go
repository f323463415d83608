package nvmeof

import (
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"hash"
	"hash/crc32"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Keys of NVMe/TCP with TLS (the secure channel of the NVMe/TCP
// transport specification, TLS 1.3 with a pre-shared key).
const (
	// KeyTLS ("true") in the volume_context connects every path of the
	// volume with TLS.
	KeyTLS = "tls"
	// KeyTLSKeyName in the volume_context names a PSK an operator
	// loaded into the kernel's .nvme keyring already: its description
	// (such as "NVMe0R01 <hostnqn> <subnqn>") or its decimal serial.
	KeyTLSKeyName = "tlsKeyName"
	// KeyTLSConcat ("true") in the volume_context of a TLS volume
	// takes the PSK from the DH-HMAC-CHAP exchange instead (secure
	// channel concatenation, connect option concat): the volume gives
	// DH-HMAC-CHAP keys and no PSK.
	KeyTLSConcat = "tlsConcat"
	// SecretTLSKey in the node stage secrets is the configured PSK in
	// the PSK interchange format nvme gen-tls-key prints
	// (NVMeTLSkey-1:<hh>:<base64>:).
	SecretTLSKey = "tlsKey"
)

// PSK hash identifiers of the interchange format: the hash that
// derives the retained PSK from the configured one.
const (
	TLSHashNone   = 0 // the configured PSK is the retained PSK
	TLSHashSHA256 = 1
	TLSHashSHA384 = 2
)

const tlsKeyPrefix = "NVMeTLSkey-1:"

// TLSKey is a validated configured PSK of NVMe/TCP in the interchange
// format
//
//	NVMeTLSkey-1:<hh>:<base64 of the key and its CRC-32>:
//
// hh 01 (SHA-256) takes a 32 byte key, 02 (SHA-384) a 48 byte key, 00
// (no transform) either. It prints as its hash and size only; the key
// leaves it only through the PSK that Derive returns for the keyring.
type TLSKey struct {
	key  []byte
	hash int
}

// ParseTLSKey validates a PSK in the interchange format: the prefix,
// the hash id, a base64 payload of a key of the hash's size followed by
// the CRC-32 (IEEE, little endian, as nvme-cli computes it) of the key,
// and the closing colon. field names the secret in errors, which never
// quote the value.
func ParseTLSKey(field, s string) (*TLSKey, error) {
	bad := func(why string) error {
		return errdefs.InvalidArgument("secret %q: not an NVMe/TCP PSK in the interchange format NVMeTLSkey-1:<hash>:<base64>: that nvme gen-tls-key prints: %s", field, why)
	}
	if s == "" {
		return nil, bad("empty")
	}
	rest, ok := strings.CutPrefix(s, tlsKeyPrefix)
	if !ok {
		return nil, bad("it does not start with NVMeTLSkey-1:")
	}
	if len(rest) < 3 || rest[2] != ':' {
		return nil, bad("the hash id is not two digits")
	}
	var hash, want int
	switch rest[:2] {
	case "00":
		hash = TLSHashNone
	case "01":
		hash, want = TLSHashSHA256, 32
	case "02":
		hash, want = TLSHashSHA384, 48
	default:
		return nil, bad("unknown hash id, want 01 (SHA-256), 02 (SHA-384) or 00 (no transform)")
	}
	payload, ok := strings.CutSuffix(rest[3:], ":")
	if !ok || strings.Contains(payload, ":") {
		return nil, bad("it does not end with a single colon after the base64 key")
	}
	b, err := base64.StdEncoding.Strict().DecodeString(payload)
	if err != nil {
		return nil, bad("the key is not valid base64")
	}
	size := len(b) - 4
	if size != 32 && size != 48 || want != 0 && size != want {
		return nil, bad(fmt.Sprintf("wrong length: %d bytes decoded, want a %s byte key and its 4 byte CRC", len(b), map[int]string{0: "32 or 48", 32: "32 (hash 01)", 48: "48 (hash 02)"}[want]))
	}
	if crc32.ChecksumIEEE(b[:size]) != binary.LittleEndian.Uint32(b[size:]) {
		return nil, bad("the CRC does not match the key (a copy and paste error?)")
	}
	return &TLSKey{key: b[:size:size], hash: hash}, nil
}

// String describes the key without its secret.
func (k *TLSKey) String() string {
	if k == nil {
		return "none"
	}
	return fmt.Sprintf("NVMeTLSkey-1:%02d:<%d byte key>:", k.hash, len(k.key))
}

// Format prints String for every verb, so that no verb prints the key.
func (k TLSKey) Format(f fmt.State, _ rune) { fmt.Fprint(f, (&k).String()) }

// cipher is the hash of the TLS cipher suite the PSK is for, as the
// identity names it: 1 for TLS_AES_128_GCM_SHA256, 2 for
// TLS_AES_256_GCM_SHA384. A key without transform picks it by its size.
func (k *TLSKey) cipher() int {
	if k.hash != TLSHashNone {
		return k.hash
	}
	if len(k.key) == 48 {
		return TLSHashSHA384
	}
	return TLSHashSHA256
}

// TLSIdentity is the PSK identity of a retained PSK for hostNQN and
// subNQN, version 0 of the NVMe/TCP specification's identity format:
// "NVMe0R<hh> <hostnqn> <subnqn>". It is the description of the key in
// the .nvme keyring: the 6.12 host driver, given no tls_key, looks for
// keys "NVMe0R02 ..." then "NVMe0R01 ..." (retained, SHA-384 first),
// then the generated "NVMe0G0x ..." ones (drivers/nvme/common/keyring.c,
// nvme_tls_psk_default); tlshd offers the description as the identity
// in the ClientHello and the target's tlshd looks the same description
// up in its own .nvme keyring.
func (k *TLSKey) TLSIdentity(hostNQN, subNQN string) string {
	return fmt.Sprintf("NVMe0R%02d %s %s", k.cipher(), hostNQN, subNQN)
}

// Derive returns the TLS PSK of the identity for hostNQN and subNQN:
// the key's payload in the .nvme keyring, which tlshd hands to the TLS
// handshake as is. It derives as nvme-cli does for gen-tls-key and
// check-tls-key --insert (libnvme's derive_retained_key and
// derive_tls_key), so that a target keyed with nvme-cli, or an array
// that follows it, has the same PSK:
//
//	retained = HKDF(hash, configured, info = L || "tls13 " || "HostNQN" || hostnqn)
//	psk      = HKDF(hash of the cipher, retained, info = L || "tls13 " || "nvme-tls-psk" || identity)
//
// where HKDF is RFC 5869's extract (no salt) and expand to L bytes, L
// the key's length as two bytes, little endian, and the labels are
// concatenated without the length bytes of RFC 8446's HkdfLabel: not the
// specification's HKDF-Expand-Label, but what nvme-cli 2.13 (libnvme
// 1.13, Debian 13) computes, checked against its --insert in the guest
// tests. Hash 00 uses the configured key as the retained one.
//
// nvme-cli 2.15 and later (libnvme's "Fixup HKDF-Expand-Label
// algorithm", 2025) derive with the RFC 8446 HkdfLabel by default and
// keep this derivation behind --compat: a target keyed by such an
// nvme-cli without --compat has another PSK. berth does not derive that
// way yet (no tool here to check it against); such a volume names an
// operator's key instead (tlsKeyName, or the kernel's choice in .nvme).
func (k *TLSKey) Derive(hostNQN, subNQN string) ([]byte, error) {
	n := len(k.key)
	retained := k.key
	if k.hash != TLSHashNone {
		var err error
		retained, err = nvmeHKDF(hashOf(k.hash), k.key, n, "HostNQN", hostNQN)
		if err != nil {
			return nil, err
		}
	}
	return nvmeHKDF(hashOf(k.cipher()), retained, n, "nvme-tls-psk", k.TLSIdentity(hostNQN, subNQN))
}

func hashOf(id int) func() hash.Hash {
	if id == TLSHashSHA384 {
		return sha512.New384
	}
	return sha256.New
}

// nvmeHKDF is nvme-cli's HKDF with its label layout (see Derive).
func nvmeHKDF(h func() hash.Hash, secret []byte, n int, label, context string) ([]byte, error) {
	info := make([]byte, 2, 2+6+len(label)+len(context))
	binary.LittleEndian.PutUint16(info, uint16(n))
	info = append(info, "tls13 "...)
	info = append(info, label...)
	info = append(info, context...)
	out, err := hkdf.Key(h, secret, nil, string(info), n)
	if err != nil {
		return nil, fmt.Errorf("derive the TLS PSK: %w", err)
	}
	return out, nil
}

// parseTLSContext reads KeyTLS, KeyTLSKeyName and KeyTLSConcat of a
// volume_context into v. A key name or concatenation without tls
// "true" is an error, and so are both together.
func parseTLSContext(vc map[string]string, v *Volume) error {
	switch s := vc[KeyTLS]; s {
	case "", "false":
	case "true":
		v.TLS = true
	default:
		return errdefs.InvalidArgument("volume_context %q=%q: want \"true\" or \"false\"", KeyTLS, s)
	}
	switch s := vc[KeyTLSConcat]; s {
	case "", "false":
	case "true":
		if !v.TLS {
			return errdefs.InvalidArgument("volume_context %q: the volume does not ask for TLS; set %q=\"true\" too", KeyTLSConcat, KeyTLS)
		}
		v.TLSConcat = true
	default:
		return errdefs.InvalidArgument("volume_context %q=%q: want \"true\" or \"false\"", KeyTLSConcat, s)
	}
	name, ok := vc[KeyTLSKeyName]
	if !ok {
		return nil
	}
	if !v.TLS {
		return errdefs.InvalidArgument("volume_context %q: the volume does not ask for TLS; set %q=\"true\" to use the key", KeyTLSKeyName, KeyTLS)
	}
	if v.TLSConcat {
		return errdefs.InvalidArgument("volume_context %q and %q: with concatenation the PSK comes from the DH-HMAC-CHAP exchange; name no key", KeyTLSKeyName, KeyTLSConcat)
	}
	if err := validateKeyName(name); err != nil {
		return err
	}
	v.TLSKeyName = name
	return nil
}

// ParseTLSSecret takes the PSK out of a request's secrets for v: nil
// when there is none. A PSK for a volume without TLS, or next to a key
// name, is an error, and so is a secret whose name mentions tls and is
// not SecretTLSKey: a misspelt name would otherwise leave the volume
// without its key.
func ParseTLSSecret(v *Volume, secrets map[string]string) (*TLSKey, error) {
	for k := range secrets {
		if k != SecretTLSKey && strings.Contains(strings.ToLower(k), "tls") {
			return nil, errdefs.InvalidArgument("secret %q: unknown TLS secret name; the PSK goes in %q", k, SecretTLSKey)
		}
	}
	s, ok := secrets[SecretTLSKey]
	switch {
	case !ok:
		return nil, nil
	case !v.TLS:
		return nil, errdefs.InvalidArgument("secret %q: the volume does not ask for TLS; set volume_context %q=\"true\" to use the PSK", SecretTLSKey, KeyTLS)
	case v.TLSKeyName != "":
		return nil, errdefs.InvalidArgument("volume_context %q and secret %q: give the PSK or name a key of the .nvme keyring, not both", KeyTLSKeyName, SecretTLSKey)
	case v.TLSConcat:
		return nil, errdefs.InvalidArgument("volume_context %q and secret %q: with concatenation the PSK comes from the DH-HMAC-CHAP exchange; give no PSK", KeyTLSConcat, SecretTLSKey)
	}
	return ParseTLSKey(SecretTLSKey, s)
}

// validateKeyName accepts a key description of printable ASCII without
// the separators of /proc/keys and the connect string, or a serial.
func validateKeyName(name string) error {
	if name == "" || len(name) > 4095 {
		return errdefs.InvalidArgument("volume_context %q: want the description or serial of a key in the .nvme keyring", KeyTLSKeyName)
	}
	if n, err := strconv.ParseInt(name, 10, 32); err == nil {
		if n <= 0 {
			return errdefs.InvalidArgument("volume_context %q=%q: a key serial is positive", KeyTLSKeyName, name)
		}
		return nil
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < ' ' || c > '~' || c == ',' {
			return errdefs.InvalidArgument("volume_context %q=%q: a key description of printable ASCII without commas", KeyTLSKeyName, name)
		}
	}
	return nil
}
