package nvmeof

import (
	"fmt"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/berth-csi/berth/internal/errdefs"
)

// DefaultPort is the IANA port of NVMe/TCP I/O controllers (trsvcid).
const DefaultPort = "4420"

// maxNQNLen is the NQN length limit of the NVMe base specification
// (NVMF_NQN_SIZE in the kernel).
const maxNQNLen = 223

// Transport types accepted in the trtype option.
const (
	TransportTCP = "tcp"
	// TransportRDMA is passed through to the kernel unchanged. berth's
	// test VMs have no RDMA devices (not even soft-RoCE), so this
	// transport is validated but never exercised by the test suite.
	TransportRDMA = "rdma"
)

// Tunables are the optional per-controller timeouts and queue counts.
// A nil field is left out of the connect string so the kernel default
// applies.
type Tunables struct {
	// CtrlLossTmo is how long (seconds) the kernel keeps reconnecting a
	// lost controller before it gives up and deletes it; -1 retries
	// forever. Kernel default 600.
	CtrlLossTmo *int
	// ReconnectDelay is the delay (seconds) between reconnect attempts.
	// Kernel default 10.
	ReconnectDelay *int
	// KeepAliveTmo is the keep-alive timeout (seconds). Kernel default 5.
	KeepAliveTmo *int
	// FastIOFailTmo is how long (seconds) I/O waits on a reconnecting
	// controller before it fails over or fails; -1 waits until
	// CtrlLossTmo. Kernel default -1.
	FastIOFailTmo *int
	// NrIOQueues limits the number of I/O queues (default: one per CPU).
	NrIOQueues *int
}

// tunableRange bounds every tunable. The kernel accepts more (it only
// rejects values <= 0 for some of them); the limits here keep out
// values that are certainly mistakes, such as a week-long keep alive.
var tunableRange = []struct {
	name     string // kernel option name
	key      string // volume_context key
	min, max int
	get      func(*Tunables) **int
}{
	{"nr_io_queues", "nrIOQueues", 1, 1024, func(t *Tunables) **int { return &t.NrIOQueues }},
	{"ctrl_loss_tmo", "ctrlLossTmo", -1, 7 * 24 * 3600, func(t *Tunables) **int { return &t.CtrlLossTmo }},
	{"reconnect_delay", "reconnectDelay", 1, 3600, func(t *Tunables) **int { return &t.ReconnectDelay }},
	{"keep_alive_tmo", "keepAliveTmo", 1, 3600, func(t *Tunables) **int { return &t.KeepAliveTmo }},
	{"fast_io_fail_tmo", "fastIOFailTmo", -1, 7 * 24 * 3600, func(t *Tunables) **int { return &t.FastIOFailTmo }},
}

// ConnectOptions are the fields of one connect request written to
// /dev/nvme-fabrics. Field names follow the kernel's option names.
type ConnectOptions struct {
	Transport  string // transport: "tcp" or "rdma"
	TrAddr     string // traddr: IP address of the target port
	TrSvcID    string // trsvcid: target port, DefaultPort when empty
	NQN        string // nqn: subsystem NQN
	HostNQN    string // hostnqn
	HostID     string // hostid: a UUID
	HostTrAddr string // host_traddr: local IP address to connect from
	HostIface  string // host_iface: local interface to connect through (tcp)
	// DHCHAPSecret is the host's DH-HMAC-CHAP key (dhchap_secret);
	// DHCHAPCtrlSecret, which needs it, the controller's
	// (dhchap_ctrl_secret). Both print without their secrets.
	DHCHAPSecret     *DHCHAPKey
	DHCHAPCtrlSecret *DHCHAPKey
	// TLS connects with TLS 1.3 (tls); TLSKey is the serial of the PSK
	// (tls_key) and Keyring the keyring the kernel hands to tlshd with
	// the handshake (keyring), 0 for the kernel's default (.nvme). Both
	// need TLS. No secret: the key stays in the kernel.
	TLS     bool
	TLSKey  int
	Keyring int
	// Concat connects with secure channel concatenation (concat): the
	// admin queue authenticates with DH-HMAC-CHAP in clear, and the
	// kernel then derives a PSK from the exchange and connects every
	// queue with TLS and that PSK. It needs DHCHAPSecret and replaces
	// TLS (the kernel refuses both).
	Concat bool
	Tunables
}

// Encode validates every field and returns the connect string the kernel
// parses, such as
//
//	transport=tcp,traddr=10.0.0.5,trsvcid=4420,nqn=nqn.2014-08.org.example:vol1,...
//
// The DH-HMAC-CHAP keys come last; the returned string holds them in
// clear and must go nowhere but the kernel.
//
// A field that holds a separator (comma, '=', newline, NUL) or has the
// wrong format is an error wrapping errdefs.ErrInvalidArgument that names
// the field; nothing is returned then.
func (o *ConnectOptions) Encode() (string, error) {
	if err := o.Validate(); err != nil {
		return "", err
	}
	port := o.TrSvcID
	if port == "" {
		port = DefaultPort
	}
	var b strings.Builder
	flag := func(k string) {
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k)
	}
	add := func(k, v string) {
		flag(k)
		b.WriteByte('=')
		b.WriteString(v)
	}
	add("transport", o.Transport)
	add("traddr", o.TrAddr)
	add("trsvcid", port)
	add("nqn", o.NQN)
	if o.HostNQN != "" {
		add("hostnqn", o.HostNQN)
	}
	if o.HostID != "" {
		add("hostid", o.HostID)
	}
	if o.HostTrAddr != "" {
		add("host_traddr", o.HostTrAddr)
	}
	if o.HostIface != "" {
		add("host_iface", o.HostIface)
	}
	for _, r := range tunableRange {
		if p := *r.get(&o.Tunables); p != nil {
			add(r.name, strconv.Itoa(*p))
		}
	}
	if o.Concat {
		flag("concat")
	}
	if o.TLS {
		flag("tls")
		if o.Keyring != 0 {
			add("keyring", strconv.Itoa(o.Keyring))
		}
		if o.TLSKey != 0 {
			add("tls_key", strconv.Itoa(o.TLSKey))
		}
	}
	// The keys are checked by ParseDHCHAPKey: base64, digits and
	// colons, no separator.
	if o.DHCHAPSecret != nil {
		add("dhchap_secret", o.DHCHAPSecret.text)
	}
	if o.DHCHAPCtrlSecret != nil {
		add("dhchap_ctrl_secret", o.DHCHAPCtrlSecret.text)
	}
	return b.String(), nil
}

// Validate checks every field of o; see Encode.
func (o *ConnectOptions) Validate() error {
	if err := validateTransport("transport", o.Transport); err != nil {
		return err
	}
	if o.TrAddr == "" {
		return errdefs.InvalidArgument("nvmeof option traddr: missing")
	}
	if err := validateIP("traddr", o.TrAddr); err != nil {
		return err
	}
	if o.TrSvcID != "" {
		if err := validatePort("trsvcid", o.TrSvcID); err != nil {
			return err
		}
	}
	if o.NQN == "" {
		return errdefs.InvalidArgument("nvmeof option nqn: missing")
	}
	if err := ValidateNQN("nqn", o.NQN); err != nil {
		return err
	}
	if o.HostNQN != "" {
		if err := ValidateNQN("hostnqn", o.HostNQN); err != nil {
			return err
		}
	}
	if o.HostID != "" {
		if err := validateUUID("hostid", o.HostID); err != nil {
			return err
		}
	}
	if o.HostTrAddr != "" {
		if err := validateIP("host_traddr", o.HostTrAddr); err != nil {
			return err
		}
	}
	if o.HostIface != "" {
		if o.Transport != TransportTCP {
			return errdefs.InvalidArgument("nvmeof option host_iface %q: only the tcp transport binds to an interface", o.HostIface)
		}
		if err := validateIface("host_iface", o.HostIface); err != nil {
			return err
		}
	}
	switch {
	case o.TLS && o.Transport != TransportTCP:
		return errdefs.InvalidArgument("nvmeof option tls: only the tcp transport has TLS")
	case !o.TLS && (o.TLSKey != 0 || o.Keyring != 0):
		return errdefs.InvalidArgument("nvmeof options tls_key and keyring: need tls")
	case o.TLSKey < 0 || o.Keyring < 0:
		return errdefs.InvalidArgument("nvmeof options tls_key and keyring: key serials are positive")
	case o.Concat && o.Transport != TransportTCP:
		return errdefs.InvalidArgument("nvmeof option concat: only the tcp transport has TLS")
	case o.Concat && o.TLS:
		return errdefs.InvalidArgument("nvmeof options concat and tls: concat starts TLS itself, with the PSK of the authentication")
	case o.Concat && o.DHCHAPSecret == nil:
		return errdefs.InvalidArgument("nvmeof option concat: needs dhchap_secret (the PSK comes from the DH-HMAC-CHAP exchange)")
	}
	if o.DHCHAPCtrlSecret != nil && o.DHCHAPSecret == nil {
		return errdefs.InvalidArgument("nvmeof option dhchap_ctrl_secret: needs dhchap_secret (the host authenticates first)")
	}
	return o.Tunables.validate(false)
}

// validate checks the ranges; errors name the volume_context key when
// inContext is set, else the kernel option.
func (t *Tunables) validate(inContext bool) error {
	for _, r := range tunableRange {
		p := *r.get(t)
		if p == nil {
			continue
		}
		if *p < r.min || *p > r.max {
			name := "nvmeof option " + r.name
			if inContext {
				name = fmt.Sprintf("volume_context %q (%s)", r.key, r.name)
			}
			return errdefs.InvalidArgument("%s %d: out of range %d..%d", name, *p, r.min, r.max)
		}
	}
	return nil
}

// checkSeparators rejects the bytes that would let a value end its own
// option or the request (comma, '=', newline, carriage return, NUL),
// other control characters, and invalid UTF-8.
func checkSeparators(field, v string) error {
	if !utf8.ValidString(v) {
		return errdefs.InvalidArgument("nvmeof option %s %q: not valid UTF-8", field, v)
	}
	for _, c := range v {
		switch {
		case c == ',':
			return errdefs.InvalidArgument("nvmeof option %s %q: contains a comma", field, v)
		case c == '=':
			return errdefs.InvalidArgument("nvmeof option %s %q: contains '='", field, v)
		case c == '\n' || c == '\r':
			return errdefs.InvalidArgument("nvmeof option %s %q: contains a newline", field, v)
		case c == 0:
			return errdefs.InvalidArgument("nvmeof option %s %q: contains a NUL byte", field, v)
		case unicode.IsControl(c):
			return errdefs.InvalidArgument("nvmeof option %s %q: contains a control character", field, v)
		}
	}
	return nil
}

func validateTransport(field, v string) error {
	if err := checkSeparators(field, v); err != nil {
		return err
	}
	switch v {
	case TransportTCP, TransportRDMA:
		return nil
	case "":
		return errdefs.InvalidArgument("nvmeof option %s: missing", field)
	}
	return errdefs.InvalidArgument("nvmeof option %s %q: unsupported, want %q or %q", field, v, TransportTCP, TransportRDMA)
}

func validateIP(field, v string) error {
	if err := checkSeparators(field, v); err != nil {
		return err
	}
	a, err := netip.ParseAddr(v)
	if err != nil {
		return errdefs.InvalidArgument("nvmeof option %s %q: not an IPv4 or IPv6 address", field, v)
	}
	if a.IsUnspecified() || a.IsMulticast() {
		return errdefs.InvalidArgument("nvmeof option %s %q: not a unicast address", field, v)
	}
	if z := a.Zone(); z != "" {
		if err := validateIface(field+" zone", z); err != nil {
			return err
		}
	}
	return nil
}

func validatePort(field, v string) error {
	if err := checkSeparators(field, v); err != nil {
		return err
	}
	n, err := strconv.ParseUint(v, 10, 16)
	if err != nil || n == 0 || v[0] == '0' {
		return errdefs.InvalidArgument("nvmeof option %s %q: not a port number 1..65535", field, v)
	}
	return nil
}

// validateIface checks a network interface name the way the kernel's
// dev_valid_name does: 1..15 bytes, no '/', ':' or white space.
func validateIface(field, v string) error {
	if err := checkSeparators(field, v); err != nil {
		return err
	}
	if v == "" || len(v) > 15 || v == "." || v == ".." || strings.ContainsAny(v, "/: \t") {
		return errdefs.InvalidArgument("nvmeof option %s %q: not a network interface name", field, v)
	}
	return nil
}

var uuidRE = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

func validateUUID(field, v string) error {
	if err := checkSeparators(field, v); err != nil {
		return err
	}
	if !uuidRE.MatchString(v) {
		return errdefs.InvalidArgument("nvmeof option %s %q: not a UUID (8-4-4-4-12 hex digits)", field, v)
	}
	return nil
}

// uuidNQNPrefix starts the NQN form that carries a UUID instead of a
// domain name (NVMe base specification, 4.7 "NVMe Qualified Names").
const uuidNQNPrefix = "nqn.2014-08.org.nvmexpress:uuid:"

// nqnRE is the domain-name NQN form: nqn.yyyy-mm.reverse.domain:name.
var nqnRE = regexp.MustCompile(`^nqn\.[0-9]{4}-(0[1-9]|1[0-2])\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*:(.+)$`)

// ValidateNQN checks an NVMe Qualified Name: either
// nqn.2014-08.org.nvmexpress:uuid:<uuid> or nqn.yyyy-mm.<reverse
// domain>:<name>, at most 223 bytes, without separators or white space.
// The discovery NQN is not a volume's subsystem and is rejected.
func ValidateNQN(field, v string) error {
	if err := checkSeparators(field, v); err != nil {
		return err
	}
	if len(v) > maxNQNLen {
		return errdefs.InvalidArgument("nvmeof option %s: %d bytes, NQNs are at most %d", field, len(v), maxNQNLen)
	}
	if strings.IndexFunc(v, unicode.IsSpace) >= 0 {
		return errdefs.InvalidArgument("nvmeof option %s %q: contains white space", field, v)
	}
	if u, ok := strings.CutPrefix(v, uuidNQNPrefix); ok {
		if !uuidRE.MatchString(u) {
			return errdefs.InvalidArgument("nvmeof option %s %q: %q is not a UUID", field, v, u)
		}
		return nil
	}
	if !nqnRE.MatchString(v) {
		return errdefs.InvalidArgument("nvmeof option %s %q: not an NQN of the form nqn.yyyy-mm.reverse.domain:name or %s<uuid>", field, v, uuidNQNPrefix)
	}
	return nil
}

// nqnUUID returns the UUID of a nqn.2014-08.org.nvmexpress:uuid:<uuid> NQN.
func nqnUUID(nqn string) (string, bool) {
	u, ok := strings.CutPrefix(nqn, uuidNQNPrefix)
	if !ok || !uuidRE.MatchString(u) {
		return "", false
	}
	return strings.ToLower(u), true
}
