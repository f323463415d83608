package nvmeof

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/keyring"
	"github.com/berth-csi/berth/internal/logctx"
	"github.com/berth-csi/berth/internal/nvmefabrics"
)

// NVMe/TCP with TLS (Linux 6.7 and later, CONFIG_NVME_TCP_TLS), as
// measured on Debian 13's 6.12.117 cloud kernel with tlshd 1.0.0:
//
//   - Reading /dev/nvme-fabrics without a connect lists the options the
//     kernel parses; a kernel with TLS lists "tls", "tls_key=%d" and
//     "keyring=%d" (tlsSupported).
//   - The kernel keeps the PSKs in its .nvme keyring (perm 1f1f0000: the
//     owner root may search, write and link it). A key "psk" has the
//     identity as its description. tls_key=<serial> picks the key for
//     every queue (decimal or 0x hex); without it the kernel searches
//     .nvme, not the keyrings below it, for "NVMe0R02 <hostnqn>
//     <subnqn>", then "NVMe0R01 ...".
//   - Each queue's handshake is an upcall to tlshd over the "handshake"
//     generic netlink family; tlshd reads the key by serial, so it must
//     possess it: it links the keyrings of /etc/tlshd.conf ([authenticate]
//     keyrings=.nvme) into its session keyring, and the keyring the
//     connect names (keyring=).
//   - No tlshd: the connect fails at once with ESRCH ("queue 0: failed
//     to start TLS: -3"). A TLS connect to a port without TLS: ETIMEDOUT
//     within a tenth of a second ("TLS handshake complete, error -110";
//     nvmet logs "unexpected pdu type 22", the TLS record). A connect
//     without TLS to a port that requires it: ECONNRESET ("failed to
//     receive icresp, error -104").
//   - A controller connected with TLS shows its key's serial in sysfs
//     tls_key (8 hex digits); a controller without TLS has no tls_key.
//   - The first TLS connect after boot took 9.7 s under TCG (tls.ko
//     loading, gnutls starting), the next ones 0.16 s.
//   - A SHA-384 PSK ("NVMe0R02"; cipher TLS_AES_256_GCM_SHA384) failed
//     in the test guests after the handshake itself: tlshd logs "The
//     kernel does not support the requested algorithm" and the connect
//     answers EIO. SHA-256 PSKs work.
//
// Secure channel concatenation (the TLS PSK derived from a DH-HMAC-CHAP
// exchange, connect option "concat") came with Linux 6.15, host and
// target: 6.12's nvme-fabrics lists no concat option and its nvmet has
// no concatenation, 7.3's have both (tlsSupported). Measured on Debian
// 13 backports' 7.3.4 with tlshd 1.0.0 (docs/volume-context.md has the
// operator's side):
//
//   - The connect gives concat and dhchap_secret, and neither tls nor
//     tls_key (the kernel refuses both). The admin queue connects in
//     clear and authenticates; the kernel derives the PSK, inserts it
//     into .nvme as "NVMe1G01 <hostnqn> <subnqn> <digest>" (perm
//     3f0b0000), and connects the admin queue again and every I/O queue
//     with TLS and that key: sysfs tls_key and tls_configured_key name
//     it. A reset authenticates again and derives another key; the
//     kernel revokes the earlier one (/proc/keys: flags R, expd).
//   - The key of a deleted controller stays linked in .nvme, valid:
//     dropKeys unlinks it.
//   - nvmet refuses the null DH group for concatenation ("NULL DH
//     group invalid for secure channel concatenation"), and a port
//     that requires TLS resets the clear admin connect (ECONNRESET): the
//     port must offer TLS without requiring it. To a port without TLS
//     the authentication passes and the handshake fails (ETIMEDOUT).
//
// Without concatenation, TLS and DH-HMAC-CHAP together authenticate
// inside the TLS session with independent keys.

// nvmeKeyring is the kernel's keyring of NVMe PSKs.
const nvmeKeyring = ".nvme"

// berthKeyring is the keyring below .nvme that holds the PSKs berth
// inserts: they are berth's to remove, an operator's keys in .nvme are
// never touched, and the kernel's own search of .nvme (for a volume
// without tls_key) never finds berth's keys.
const berthKeyring = "berth"

// tlsConn is what the connects of a TLS volume use.
type tlsConn struct {
	key      int // the PSK's serial (tls_key)
	keyring  int // the keyring named in the connect (0: the kernel's default)
	inserted bool
	// concat: no PSK of berth's; the kernel derives one from the
	// DH-HMAC-CHAP exchange of each controller (connect option concat).
	concat bool
}

// tlsSupported reports whether the kernel's connect interface parses
// the tls options, and with concat the concat option. The option list
// is kept once read; a failed read (the module not loaded yet) is tried
// again at the next call.
func (t *Transport) tlsSupported(concat bool) error {
	t.optsMu.Lock()
	defer t.optsMu.Unlock()
	if t.optNames == nil {
		opts, err := nvmefabrics.Options(t.opts.FabricsDevice)
		if err != nil {
			return err
		}
		t.optNames = map[string]bool{}
		for _, o := range strings.Split(opts, ",") {
			name, _, _ := strings.Cut(o, "=")
			t.optNames[name] = true
		}
	}
	if !t.optNames["tls"] || !t.optNames["tls_key"] {
		return fmt.Errorf("the volume asks for TLS, but this kernel's NVMe/TCP has none (the options of %s list no tls: CONFIG_NVME_TCP_TLS is not set; TLS needs Linux 6.7 or later built with it, such as Debian 13's kernels): %w",
			t.opts.FabricsDevice, errdefs.ErrUnsupported)
	}
	if concat && !t.optNames["concat"] {
		return fmt.Errorf("the volume asks for secure channel concatenation (volume_context %q), but this kernel's NVMe/TCP has none (the options of %s list no concat: it came with Linux 6.15; Debian 13's 6.12 lacks it, its backports' 7.3 has it): use a newer kernel, or give the volume a PSK (secret %q) instead: %w",
			KeyTLSConcat, t.opts.FabricsDevice, SecretTLSKey, errdefs.ErrUnsupported)
	}
	return nil
}

// nvmeKeyring returns the serial of the kernel's .nvme keyring.
func (t *Transport) nvmeKeyring() (int, error) {
	keys, err := t.listKeys()
	if err != nil {
		return 0, err
	}
	id, err := keyring.Find(keys, nvmeKeyring)
	if errors.Is(err, errdefs.ErrNotFound) {
		return 0, fmt.Errorf("the volume asks for TLS, but the kernel has no %s keyring (the nvme_keyring module, CONFIG_NVME_KEYRING, is not loaded: modprobe nvme-tcp): %w", nvmeKeyring, errdefs.ErrUnsupported)
	}
	return id, err
}

// prepareTLS finds or inserts the volume's PSK before any connect; see
// tlsConn. ctrls are the subsystem's controllers.
func (tg *Target) prepareTLS(ctx context.Context, host HostIdentity, ctrls []Controller) (*tlsConn, error) {
	if err := tg.t.tlsSupported(tg.vol.TLSConcat); err != nil {
		return nil, err
	}
	nvme, err := tg.t.nvmeKeyring()
	if err != nil {
		return nil, err
	}
	if tg.vol.TLSConcat {
		// The kernel derives the PSK after the authentication and
		// puts it into .nvme, where tlshd finds it.
		if tg.auth == nil {
			return nil, errdefs.InvalidArgument("volume_context %q: secure channel concatenation derives the TLS PSK from DH-HMAC-CHAP; give the host key in the secret %q", KeyTLSConcat, SecretDHCHAPKey)
		}
		return &tlsConn{concat: true}, nil
	}
	if tg.tlsKey == nil {
		return tg.operatorKey(nvme, host)
	}
	identity := tg.tlsKey.TLSIdentity(host.NQN, tg.vol.NQN)
	psk, err := tg.tlsKey.Derive(host.NQN, tg.vol.NQN)
	if err != nil {
		return nil, err
	}
	defer clear(psk)
	c := &tlsConn{}
	tg.t.keyMu.Lock()
	defer tg.t.keyMu.Unlock()
	err = keyring.Possess(nvme, func(p keyring.Possessor) error {
		ring, err := p.AddKeyring(berthKeyring)
		if err != nil {
			return err
		}
		c.keyring = ring
		bp := p.Sub(ring)
		id, err := bp.Search("psk", identity)
		if err != nil {
			return err
		}
		if id != 0 {
			cur, err := bp.Read(id)
			if err != nil {
				return err
			}
			same := equalSecret(cur, psk)
			clear(cur)
			if same {
				c.key = id
				return nil
			}
			// Another PSK for the same host and subsystem. Replacing
			// it in place would change the key of controllers
			// connected with it at their next reconnect.
			for _, ctrl := range ctrls {
				if ctrl.HostNQN != host.NQN || ctrl.Deleting() {
					continue
				}
				if s, _ := tg.t.sys.readTLSKey(ctrl.Name); s == id {
					return fmt.Errorf("controller %s of subsystem %s is connected with another TLS PSK (key %08x) than this volume gives: berth does not reuse it, nor change the key of a connected controller; stage the volume with the PSK the controller was connected with, or unstage every volume of the subsystem on this node so that the next stage connects with the new key: %w",
						ctrl.Name, tg.vol.NQN, id, errdefs.ErrFailedPrecondition)
				}
			}
		}
		id, err = bp.Add("psk", identity, psk)
		if err != nil {
			return err
		}
		c.key, c.inserted = id, true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("TLS PSK: %w", err)
	}
	if c.inserted {
		logctx.From(ctx, tg.t.log).Info("nvmeof: inserted the TLS PSK", "target", tg.Key(), "identity", identity, "key", fmt.Sprintf("%08x", c.key))
	}
	return c, nil
}

// operatorKey finds the PSK an operator loaded into .nvme: the one
// tlsKeyName names, else the kernel's choice for the host and
// subsystem, which berth then names in the connect so that the reuse
// check can compare it.
func (tg *Target) operatorKey(nvme int, host HostIdentity) (*tlsConn, error) {
	var want []string
	name := tg.vol.TLSKeyName
	if name == "" {
		for _, h := range []int{TLSHashSHA384, TLSHashSHA256} {
			want = append(want, fmt.Sprintf("NVMe0R%02d %s %s", h, host.NQN, tg.vol.NQN))
		}
	}
	c := &tlsConn{}
	err := keyring.Possess(nvme, func(p keyring.Possessor) error {
		keys, err := p.Links()
		if err != nil {
			return err
		}
		if name != "" {
			for _, k := range keys {
				if k.Type == "psk" && (k.Description == name || strconv.Itoa(k.Serial) == name) {
					c.key = k.Serial
					return nil
				}
			}
			return nil
		}
		for _, w := range want {
			for _, k := range keys {
				if k.Type == "psk" && k.Description == w {
					c.key = k.Serial
					return nil
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("TLS PSK: %w", err)
	}
	if c.key == 0 {
		if name != "" {
			return nil, fmt.Errorf("TLS PSK: no key %q in the %s keyring: load it there (nvme gen-tls-key --insert, nvme tls-key --import), or give the PSK in the secret %q: %w", name, nvmeKeyring, SecretTLSKey, errdefs.ErrFailedPrecondition)
		}
		return nil, fmt.Errorf("TLS PSK: the volume gives no PSK (secret %q) and the %s keyring has no key %q: give the PSK in the node stage secrets, or load it into the keyring (nvme check-tls-key --insert --hostnqn %s --subsysnqn %s): %w",
			SecretTLSKey, nvmeKeyring, want[len(want)-1], host.NQN, tg.vol.NQN, errdefs.ErrFailedPrecondition)
	}
	return c, nil
}

// dropKeys removes the PSKs berth inserted for the host and the
// volume's subsystem once no controller of the subsystem for the host is
// left, and for a volume with concatenation the PSKs the kernel
// generated for them: 7.3 leaves a deleted controller's key in .nvme.
// Keys an operator loaded are not berth's and stay.
func (tg *Target) dropKeys(ctx context.Context, host string) {
	ctrls, err := tg.t.sys.readControllers(tg.vol.NQN)
	if err != nil {
		logctx.From(ctx, tg.t.log).Warn("nvmeof: TLS PSK kept", "target", tg.Key(), "error", err)
		return
	}
	for _, c := range ctrls {
		if c.HostNQN == host && !c.Deleting() {
			return
		}
	}
	nvme, err := tg.t.nvmeKeyring()
	if err != nil {
		return
	}
	tg.t.keyMu.Lock()
	defer tg.t.keyMu.Unlock()
	err = keyring.Possess(nvme, func(p keyring.Possessor) error {
		if tg.vol.TLSConcat {
			keys, err := p.Links()
			if err != nil {
				return err
			}
			for _, k := range keys {
				if k.Type == "psk" && generatedPSKFor(k.Description, host, tg.vol.NQN) {
					if err := p.Unlink(k.Serial); err != nil {
						return err
					}
					logctx.From(ctx, tg.t.log).Info("nvmeof: removed a TLS PSK the kernel generated", "target", tg.Key(), "key", fmt.Sprintf("%08x", k.Serial))
				}
			}
		}
		ring, err := p.Search("keyring", berthKeyring)
		if err != nil || ring == 0 {
			return err
		}
		bp := p.Sub(ring)
		keys, err := bp.Links()
		if err != nil {
			return err
		}
		for _, k := range keys {
			for _, h := range []int{TLSHashSHA256, TLSHashSHA384} {
				if k.Type == "psk" && k.Description == fmt.Sprintf("NVMe0R%02d %s %s", h, host, tg.vol.NQN) {
					if err := bp.Unlink(k.Serial); err != nil {
						return err
					}
					logctx.From(ctx, tg.t.log).Info("nvmeof: removed the TLS PSK", "target", tg.Key(), "identity", k.Description, "key", fmt.Sprintf("%08x", k.Serial))
				}
			}
		}
		return nil
	})
	if err != nil {
		logctx.From(ctx, tg.t.log).Warn("nvmeof: TLS PSK kept", "target", tg.Key(), "error", err)
	}
}

// equalSecret compares two payloads in constant time.
func equalSecret(a, b []byte) bool {
	return subtle.ConstantTimeCompare(a, b) == 1
}

// readTLSKey returns the serial of the PSK a controller was connected
// with, from sysfs tls_key; 0 for a controller without TLS (no such
// attribute, or a kernel without TLS).
func (s sysTree) readTLSKey(name string) (int, error) {
	v, err := s.readAttr(s.root.Path("class", "nvme", name), "tls_key")
	if err != nil || v == "" || v == "none" {
		return 0, nil
	}
	n, err := strconv.ParseUint(v, 16, 31)
	if err != nil {
		return 0, fmt.Errorf("read controller %s: tls_key %q: not a key serial", name, v)
	}
	return int(n), nil
}

// checkTLSReuse refuses to reuse controller name for a TLS volume unless
// it was connected with the volume's PSK.
func (tg *Target) checkTLSReuse(name string, c *tlsConn) error {
	if c == nil {
		return nil
	}
	got, err := tg.t.sys.readTLSKey(name)
	if err != nil {
		return err
	}
	if c.concat {
		return tg.checkConcatReuse(name, got)
	}
	if got == c.key {
		return nil
	}
	what := "without TLS"
	if got != 0 {
		what = fmt.Sprintf("with another TLS PSK (key %08x, this volume's is %08x)", got, c.key)
	}
	return fmt.Errorf("controller %s of subsystem %s is connected %s, and this volume asks for TLS: berth does not reuse it, nor change a connected controller; unstage every volume of the subsystem on this node so that the next stage connects with TLS: %w",
		name, tg.vol.NQN, what, errdefs.ErrFailedPrecondition)
}

// checkConcatReuse refuses to reuse controller name, whose tls_key is
// got, for a volume with concatenation unless its PSK is one the kernel
// generated from an authentication: a controller without TLS, or with a
// configured PSK, is not. (Its DH-HMAC-CHAP keys are checkReuse's.)
func (tg *Target) checkConcatReuse(name string, got int) error {
	what := "without TLS"
	if got != 0 {
		keys, err := tg.t.listKeys()
		if err != nil {
			return fmt.Errorf("controller %s: TLS PSK %08x: %w", name, got, err)
		}
		for _, k := range keys {
			if k.Serial == got && k.Type == "psk" && generatedPSK(k.Description) {
				return nil
			}
		}
		what = fmt.Sprintf("with a configured TLS PSK (key %08x), not one derived from its authentication", got)
	}
	return fmt.Errorf("controller %s of subsystem %s is connected %s, and this volume asks for secure channel concatenation: berth does not reuse it, nor change a connected controller; unstage every volume of the subsystem on this node so that the next stage connects with concatenation: %w",
		name, tg.vol.NQN, what, errdefs.ErrFailedPrecondition)
}

// generatedPSK reports whether a psk key's description is the identity
// of a PSK the kernel generated for concatenation, "NVMe1G<hh> <hostnqn>
// <subnqn> <digest>" (measured on 7.3), rather than a retained one
// ("NVMe0R<hh> ...", "NVMe1R<hh> ...").
func generatedPSK(desc string) bool {
	return len(desc) > 8 && strings.HasPrefix(desc, "NVMe") && desc[5] == 'G' && desc[8] == ' '
}

// generatedPSKFor reports whether desc is a generated PSK for host and
// subNQN.
func generatedPSKFor(desc, host, subNQN string) bool {
	f := strings.Fields(desc)
	return generatedPSK(desc) && len(f) >= 3 && f[1] == host && f[2] == subNQN
}

// listKeys lists the kernel's keys (/proc/keys).
func (t *Transport) listKeys() ([]keyring.Key, error) {
	if t.opts.listKeys != nil {
		return t.opts.listKeys()
	}
	return keyring.List()
}

// tlsConnectError explains a failed TLS connect (see the measurements
// above).
func (tg *Target) tlsConnectError(ctx context.Context, p Path, err error) error {
	switch {
	case tg.vol.TLSConcat && errors.Is(err, errReset):
		return fmt.Errorf("connect with secure channel concatenation: the target reset the connection, which concatenation opens in clear to authenticate before TLS starts: its port requires TLS from the first byte (nvmet: addr_treq \"required\"); for concatenation the port offers TLS but lets the connect start in clear (addr_tsas tls1.3, addr_treq \"not required\"), or give the volume a PSK (secret %q) instead: %w",
			SecretTLSKey, errdefs.ErrFailedPrecondition)
	case tg.vol.TLSConcat && errors.Is(err, errSilent) && tg.portAccepts(ctx, p):
		return fmt.Errorf("connect with secure channel concatenation: the DH-HMAC-CHAP authentication passed, but the TLS handshake with the PSK derived from it failed: the target's port does not offer TLS (nvmet: addr_tsas tls1.3), or the target does not derive the PSK from the authentication (nvmet has concatenation since Linux 6.15, and needs a DH group for the host: dhchap_dhgroup); check the port's TLS setting and the target's support: %w",
			errdefs.ErrFailedPrecondition)
	case errors.Is(err, errNoHandshake):
		return fmt.Errorf("connect with TLS: the kernel found no TLS handshake daemon (the handshake upcall has no listener): start tlshd (ktls-utils) on the node, with %s in its keyrings (/etc/tlshd.conf [authenticate] keyrings=%s): %w", nvmeKeyring, nvmeKeyring, errdefs.ErrUnavailable)
	case errors.Is(err, errSilent) && tg.portAccepts(ctx, p):
		// Not silent after all: the handshake failed, and the path
		// is not left out of the next stages (noteSilent).
		// A wrong PSK and a port without TLS look the same from here
		// (measured on 6.12: ETIMEDOUT within a second, both).
		return fmt.Errorf("connect with TLS: the target's port accepts TCP connections, but the TLS handshake failed: the target has no PSK for identity %q, or another one than the volume gives, or the port does not offer TLS (nvmet: addr_tsas tls1.3); check the target's PSK for this host and subsystem against the volume's, and the port's TLS setting: %w",
			tg.identityHint(), errdefs.ErrFailedPrecondition)
	}
	return err
}

// identityHint is the identity the target must know, for errors.
func (tg *Target) identityHint() string {
	host, _ := tg.t.HostIdentity()
	if tg.tlsKey != nil {
		return tg.tlsKey.TLSIdentity(host.NQN, tg.vol.NQN)
	}
	if tg.vol.TLSKeyName != "" {
		return tg.vol.TLSKeyName
	}
	return fmt.Sprintf("NVMe0R0x %s %s", host.NQN, tg.vol.NQN)
}

// portAccepts reports whether p's TCP port accepts a connection now.
func (tg *Target) portAccepts(ctx context.Context, p Path) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var d net.Dialer
	if p.HostTrAddr != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(p.HostTrAddr)}
	}
	c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(p.TrAddr, p.TrSvcID))
	if err != nil {
		return false
	}
	c.Close()
	return true
}
