package nvmeof

import (
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// volume_context keys. The camel-case names are berth's; the aliases
// are csi-driver-nvmf's attribute names so that its StorageClasses and
// PersistentVolumes keep working.
const (
	KeyTransport      = "transport"   // "nvmeof" (chooses this transport in the agent)
	KeyTrType         = "trtype"      // "tcp" (default) or "rdma"
	KeyTrAddr         = "traddr"      // target address, or a comma-separated list of them
	KeyTrSvcID        = "trsvcid"     // port of the traddr addresses, default 4420
	KeyTargets        = "targets"     // comma-separated list of host:port paths
	KeyNQN            = "nqn"         // subsystem NQN (required)
	KeyNSID           = "nsid"        // namespace ID
	KeyUUID           = "uuid"        // namespace UUID
	KeyNGUID          = "nguid"       // namespace NGUID
	KeyHostTrAddr     = "hostTrAddr"  // local address to connect from
	KeyHostIface      = "hostIface"   // local interface to connect through
	KeyCtrlLossTmo    = "ctrlLossTmo" // seconds, -1 = forever
	KeyReconnectDelay = "reconnectDelay"
	KeyKeepAliveTmo   = "keepAliveTmo"
	KeyFastIOFailTmo  = "fastIOFailTmo" // seconds, -1 = off
	KeyNrIOQueues     = "nrIOQueues"
	// KeyCtrlLossForever ("true") accepts ctrlLossTmo=-1; see
	// checkReconnectForever.
	KeyCtrlLossForever = "ctrlLossForever"

	// csi-driver-nvmf names.
	AliasTrType = "targetTrType"
	AliasTrAddr = "targetTrAddr"
	AliasTrPort = "targetTrPort"
	AliasUUID   = "deviceUUID"
)

// maxPaths bounds the distinct paths of a volume: each is a controller,
// connected in parallel at attach. Arrays offer two to eight.
const maxPaths = 32

// Volume is a parsed, validated volume_context: where the namespace is
// and how to find it once connected.
type Volume struct {
	NQN   string
	NSID  uint32 // 0 = not given
	UUID  string // lower case, "" = not given
	NGUID string // lower case 8-4-4-4-12 form, "" = not given
	// Paths are the distinct target addresses; each gets one
	// controller, and native multipath joins them under one head.
	Paths []Path
	Tunables
	// TLS connects every path with TLS (KeyTLS); TLSKeyName names the
	// PSK in the .nvme keyring to use (KeyTLSKeyName), "" for the PSK
	// of the stage secrets or, without one, the keyring's key for the
	// host and subsystem. TLSConcat takes the PSK from the
	// DH-HMAC-CHAP exchange instead (KeyTLSConcat).
	TLS        bool
	TLSKeyName string
	TLSConcat  bool
}

// Key is the volume's canonical identity: the subsystem NQN and the
// most specific namespace identifier given.
func (v *Volume) Key() string {
	switch {
	case v.UUID != "":
		return "nvmeof:" + v.NQN + "/uuid=" + v.UUID
	case v.NGUID != "":
		return "nvmeof:" + v.NQN + "/nguid=" + v.NGUID
	}
	return "nvmeof:" + v.NQN + "/nsid=" + strconv.FormatUint(uint64(v.NSID), 10)
}

// ParseVolumeContext validates the NVMe-oF keys of a volume_context.
// Unknown keys are ignored: the context also carries keys of the CO and
// of other layers (fsType, provisioner identity).
func ParseVolumeContext(vc map[string]string) (*Volume, error) {
	get := func(keys ...string) (string, string, error) {
		var val, from string
		for _, k := range keys {
			v, ok := vc[k]
			if !ok {
				continue
			}
			if from != "" && v != val {
				return "", "", errdefs.InvalidArgument("volume_context %q=%q and %q=%q disagree", from, val, k, v)
			}
			val, from = v, k
		}
		if from != "" {
			if err := contextSeparators(from, val); err != nil {
				return "", "", err
			}
		}
		return val, from, nil
	}
	v := &Volume{}

	trtype, key, err := get(KeyTrType, AliasTrType)
	if err != nil {
		return nil, err
	}
	if trtype == "" {
		trtype = TransportTCP
		key = KeyTrType
	}
	trtype = strings.ToLower(trtype)
	if trtype != TransportTCP && trtype != TransportRDMA {
		return nil, errdefs.InvalidArgument("volume_context %q=%q: unsupported transport type, want %q or %q", key, trtype, TransportTCP, TransportRDMA)
	}

	nqn, key, err := get(KeyNQN)
	if err != nil {
		return nil, err
	}
	if nqn == "" {
		return nil, errdefs.InvalidArgument("volume_context %q: missing (the subsystem NQN)", KeyNQN)
	}
	if err := ValidateNQN("nqn", nqn); err != nil {
		return nil, fmt.Errorf("volume_context %q: %w", key, err)
	}
	v.NQN = nqn

	if s, key, err := get(KeyNSID); err != nil {
		return nil, err
	} else if s != "" {
		n, err := strconv.ParseUint(s, 10, 32)
		if err != nil || n == 0 || n == 0xffffffff {
			return nil, errdefs.InvalidArgument("volume_context %q=%q: not a namespace ID 1..4294967294", key, s)
		}
		v.NSID = uint32(n)
	}
	if s, key, err := get(KeyUUID, AliasUUID); err != nil {
		return nil, err
	} else if s != "" {
		if !uuidRE.MatchString(s) {
			return nil, errdefs.InvalidArgument("volume_context %q=%q: not a UUID", key, s)
		}
		v.UUID = strings.ToLower(s)
	}
	if s, key, err := get(KeyNGUID); err != nil {
		return nil, err
	} else if s != "" {
		g, ok := normalizeNGUID(s)
		if !ok {
			return nil, errdefs.InvalidArgument("volume_context %q=%q: not an NGUID (32 hex digits)", key, s)
		}
		v.NGUID = g
	}
	if v.NSID == 0 && v.UUID == "" && v.NGUID == "" {
		return nil, errdefs.InvalidArgument("volume_context: no namespace given; set %q, %q (or %q) or %q", KeyNSID, KeyUUID, AliasUUID, KeyNGUID)
	}

	port, portKey, err := get(KeyTrSvcID, AliasTrPort)
	if err != nil {
		return nil, err
	}
	if port == "" {
		port = DefaultPort
	} else if err := validatePort(portKey, port); err != nil {
		return nil, fmt.Errorf("volume_context %q: %w", portKey, err)
	}
	hostTrAddr, key, err := get(KeyHostTrAddr)
	if err != nil {
		return nil, err
	}
	if hostTrAddr != "" {
		if err := validateIP("host_traddr", hostTrAddr); err != nil {
			return nil, fmt.Errorf("volume_context %q: %w", key, err)
		}
	}
	hostIface, key, err := get(KeyHostIface)
	if err != nil {
		return nil, err
	}
	if hostIface != "" {
		if trtype != TransportTCP {
			return nil, errdefs.InvalidArgument("volume_context %q=%q: only the tcp transport binds to an interface", key, hostIface)
		}
		if err := validateIface("host_iface", hostIface); err != nil {
			return nil, fmt.Errorf("volume_context %q: %w", key, err)
		}
	}
	addPath := func(key, host, port string) error {
		if err := validateHost(host); err != nil {
			return fmt.Errorf("volume_context %q: %w", key, err)
		}
		if err := validatePort("trsvcid", port); err != nil {
			return fmt.Errorf("volume_context %q: %w", key, err)
		}
		if a, err := netip.ParseAddr(host); err == nil {
			host = a.String()
		} else {
			host = strings.ToLower(host)
		}
		p := Path{TrType: trtype, TrAddr: host, TrSvcID: port, HostTrAddr: hostTrAddr, HostIface: hostIface}
		if slices.Contains(v.Paths, p) {
			return nil
		}
		// Refused as soon as it is exceeded, the limit also bounds
		// the duplicate check.
		if len(v.Paths) == maxPaths {
			return errdefs.InvalidArgument("volume_context %q: more than %d distinct paths; berth connects at most %d controllers per volume", key, maxPaths, maxPaths)
		}
		v.Paths = append(v.Paths, p)
		return nil
	}
	// traddr (or targetTrAddr): addresses sharing the trsvcid port.
	addrs, addrKey, err := getList(vc, KeyTrAddr, AliasTrAddr)
	if err != nil {
		return nil, err
	}
	for _, a := range addrs {
		a = strings.TrimSuffix(strings.TrimPrefix(a, "["), "]")
		if err := addPath(addrKey, a, port); err != nil {
			return nil, err
		}
	}
	// targets: host:port entries; the port defaults to trsvcid.
	targets, _, err := getList(vc, KeyTargets)
	if err != nil {
		return nil, err
	}
	for _, t := range targets {
		host, p, err := splitTarget(t, port)
		if err != nil {
			return nil, err
		}
		if err := addPath(KeyTargets, host, p); err != nil {
			return nil, err
		}
	}
	if len(v.Paths) == 0 {
		return nil, errdefs.InvalidArgument("volume_context: no target address; set %q (or %q) or %q", KeyTrAddr, AliasTrAddr, KeyTargets)
	}

	for _, r := range tunableRange {
		s, key, err := get(r.key)
		if err != nil {
			return nil, err
		}
		if s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil {
			return nil, errdefs.InvalidArgument("volume_context %q=%q: not an integer", key, s)
		}
		*r.get(&v.Tunables) = &n
	}
	if err := v.Tunables.validate(true); err != nil {
		return nil, err
	}
	if err := checkReconnectForever(vc, v.Tunables); err != nil {
		return nil, err
	}
	if err := parseTLSContext(vc, v); err != nil {
		return nil, err
	}
	if v.TLS && trtype != TransportTCP {
		return nil, errdefs.InvalidArgument("volume_context %q=\"true\": TLS is a secure channel of the tcp transport, not %s", KeyTLS, trtype)
	}
	return v, nil
}

// checkReconnectForever refuses ctrlLossTmo=-1 unless the volume opts in
// with ctrlLossForever=true. A controller that reconnects forever never
// gives its I/O up: a node cut off from the target keeps the volume's
// dirty pages and queued writes, and sends them the moment a path comes
// back, even after the volume was staged on another node, and an unstage
// on a node whose paths are all gone waits with it. The bounded default
// (600 s) fails that I/O instead. The opt-in is for a volume whose
// single writer is ensured elsewhere (the array fences the old node).
func checkReconnectForever(vc map[string]string, t Tunables) error {
	forever := t.CtrlLossTmo != nil && *t.CtrlLossTmo == -1
	optIn := vc[KeyCtrlLossForever]
	switch optIn {
	case "", "false":
		if forever {
			return errdefs.InvalidArgument("volume_context %q=-1 reconnects a lost controller forever: its queued writes reach the target whenever a path comes back, even after another node took the volume over, and an unstage without paths cannot finish; give ctrlLossTmo in seconds (kernel default 600), or set %q=\"true\" where the array itself keeps a single writer", KeyCtrlLossTmo, KeyCtrlLossForever)
		}
	case "true":
		if !forever {
			return errdefs.InvalidArgument("volume_context %q=\"true\" without %q=-1", KeyCtrlLossForever, KeyCtrlLossTmo)
		}
	default:
		return errdefs.InvalidArgument("volume_context %q=%q: want \"true\" or \"false\"", KeyCtrlLossForever, optIn)
	}
	return nil
}

// contextSeparators is checkSeparators for a volume_context value,
// where commas separate list entries of traddr and targets.
func contextSeparators(key, v string) error {
	if key == KeyTrAddr || key == AliasTrAddr || key == KeyTargets {
		for _, part := range strings.Split(v, ",") {
			if err := checkSeparators(key, part); err != nil {
				return fmt.Errorf("volume_context %q: %w", key, err)
			}
		}
		return nil
	}
	if err := checkSeparators(key, v); err != nil {
		return fmt.Errorf("volume_context %q: %w", key, err)
	}
	return nil
}

// getList returns the comma-separated entries of the first of keys that
// is set; white space around entries is dropped, empty entries are an
// error.
func getList(vc map[string]string, keys ...string) ([]string, string, error) {
	var out []string
	var from string
	for _, k := range keys {
		s, ok := vc[k]
		if !ok {
			continue
		}
		if from != "" && s != vc[from] {
			return nil, "", errdefs.InvalidArgument("volume_context %q=%q and %q=%q disagree", from, vc[from], k, s)
		}
		if from != "" {
			continue
		}
		from = k
		if err := contextSeparators(k, s); err != nil {
			return nil, "", err
		}
		for _, e := range strings.Split(s, ",") {
			e = strings.TrimSpace(e)
			if e == "" {
				return nil, "", errdefs.InvalidArgument("volume_context %q=%q: empty entry", k, s)
			}
			out = append(out, e)
		}
	}
	return out, from, nil
}

// splitTarget splits one entry of the targets list: "10.0.0.5:4420",
// "[fd00::5]:4420", "array.example.com:4420", or an address without a
// port (a bare IPv6 address needs no brackets then).
func splitTarget(t, defPort string) (host, port string, err error) {
	if strings.HasPrefix(t, "[") && strings.HasSuffix(t, "]") {
		return t[1 : len(t)-1], defPort, nil
	}
	if strings.HasPrefix(t, "[") || strings.Count(t, ":") == 1 {
		host, port, err := net.SplitHostPort(t)
		if err != nil || host == "" || port == "" {
			return "", "", errdefs.InvalidArgument("volume_context %q entry %q: want host:port or [ipv6]:port", KeyTargets, t)
		}
		return host, port, nil
	}
	return t, defPort, nil
}

// validateHost accepts an IP address or a DNS host name. Host names are
// resolved once per attach (net.DefaultResolver, bounded by the call's
// context) and the first address is used: the kernel takes addresses only.
func validateHost(h string) error {
	if _, err := netip.ParseAddr(h); err == nil {
		return validateIP("traddr", h)
	}
	if err := checkSeparators("traddr", h); err != nil {
		return err
	}
	if len(h) == 0 || len(h) > 253 {
		return errdefs.InvalidArgument("nvmeof option traddr %q: not an IP address or host name", h)
	}
	for _, l := range strings.Split(strings.TrimSuffix(h, "."), ".") {
		if len(l) == 0 || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return errdefs.InvalidArgument("nvmeof option traddr %q: not an IP address or host name", h)
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return errdefs.InvalidArgument("nvmeof option traddr %q: not an IP address or host name", h)
			}
		}
	}
	return nil
}

// normalizeNGUID accepts 32 hex digits, with or without the dashes of
// the UUID layout that sysfs prints, and returns the sysfs form.
func normalizeNGUID(s string) (string, bool) {
	h := strings.ReplaceAll(s, "-", "")
	if len(h) != 32 {
		return "", false
	}
	if _, err := hex.DecodeString(h); err != nil {
		return "", false
	}
	h = strings.ToLower(h)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32], true
}
