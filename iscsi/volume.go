package iscsi

import (
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// volume_context keys. The names of csi-driver-iscsi are kept so that its
// PersistentVolumes work unchanged.
const (
	KeyTargetPortal      = "targetPortal"
	KeyPortals           = "portals"
	KeyIQN               = "iqn"
	KeyLUN               = "lun"
	KeyInterface         = "iscsiInterface"
	KeyDiscoveryCHAPAuth = "discoveryCHAPAuth"
	KeySessionCHAPAuth   = "sessionCHAPAuth"
	// KeyDiscovery asks for a SendTargets discovery through the first
	// portal before login ("true"); discoveryCHAPAuth=true implies it.
	KeyDiscovery = "discovery"
	// KeyWWID is the WWID the LUN must report (device/wwid, or the
	// "3<naa>" form multipath shows). Optional but recommended: when set, a
	// LUN reporting another WWID is refused.
	KeyWWID = "wwid"
	// KeyMultipath is "true" (a dm-multipath map is required, even over one
	// portal), "false" (single path: log in to the first portal that
	// answers, even when several are listed) or "" / "auto" (a map when
	// several portals are listed).
	KeyMultipath = "multipath"
)

// Session parameters settable per volume (volume_context) and per node
// (Options.Tunables), named as in open-iscsi's node records.
const (
	ParamReplacementTimeout = "node.session.timeo.replacement_timeout"
	ParamLoginTimeout       = "node.conn[0].timeo.login_timeout"
	ParamLoginRetryMax      = "node.session.initial_login_retry_max"
)

// berth serve's defaults for the initial login, in place of open-iscsi's
// (15 s and 8 retries): iscsiadm tries a login 1 + retries times, each
// bounded by the login timeout, so a portal that drops every packet (no
// RST) costs a stage 15 s instead of 120 s, while a portal that answers
// logs in within a second. A multipath volume's portals log in at once;
// a single-path volume tries them in order, so its second portal still
// answers within 30 s of the stage when the first is silent.
const (
	DefaultLoginTimeout  = 5
	DefaultLoginRetryMax = 2
)

// paramRanges bounds each session parameter (seconds or a count).
var paramRanges = map[string][2]int{
	ParamReplacementTimeout: {0, 86400},
	ParamLoginTimeout:       {1, 3600},
	ParamLoginRetryMax:      {0, 1000},
}

// Secret keys, as csi-driver-iscsi and open-iscsi name them.
const (
	SecretSessionUsername     = "node.session.auth.username"
	SecretSessionPassword     = "node.session.auth.password"
	SecretSessionUsernameIn   = "node.session.auth.username_in"
	SecretSessionPasswordIn   = "node.session.auth.password_in"
	SecretDiscoveryUsername   = "discovery.sendtargets.auth.username"
	SecretDiscoveryPassword   = "discovery.sendtargets.auth.password"
	SecretDiscoveryUsernameIn = "discovery.sendtargets.auth.username_in"
	SecretDiscoveryPasswordIn = "discovery.sendtargets.auth.password_in"
)

// maxLUN is the highest LUN the volume may name; larger flat-space LUNs
// are not used by the targets berth supports.
const maxLUN = 16383

// maxCHAPLen is the longest user name or secret open-iscsi stores (its
// record fields are 256-byte C strings).
const maxCHAPLen = 255

// maxPortals bounds the distinct portals of a volume: each is a session
// logged in at attach.
const maxPortals = 32

// CHAP holds one direction or both directions of CHAP credentials. Its
// String and LogValue methods never print the secrets.
type CHAP struct {
	Username, Password     string // the initiator authenticates to the target
	UsernameIn, PasswordIn string // the target authenticates back (mutual)
}

// Mutual reports whether the target must authenticate too.
func (c *CHAP) Mutual() bool { return c != nil && c.UsernameIn != "" }

// String describes the credentials without their values.
func (c *CHAP) String() string {
	if c == nil {
		return "none"
	}
	if c.Mutual() {
		return "CHAP (mutual)"
	}
	return "CHAP"
}

// GoString keeps %#v from printing the secrets.
func (c *CHAP) GoString() string { return c.String() }

// Format keeps every verb, %v and %+v included, from printing the secrets.
func (c CHAP) Format(f fmt.State, verb rune) { fmt.Fprint(f, (&c).String()) }

// LogValue keeps slog from printing the secrets.
func (c *CHAP) LogValue() slog.Value { return slog.StringValue(c.String()) }

// Volume is a validated iSCSI volume description.
type Volume struct {
	IQN     string
	Portals []Portal
	LUN     int
	// Iface is the open-iscsi interface record ("default" = iscsi_tcp
	// over the routing table).
	Iface string
	// WWID is the normalized expected WWID, "" when not given.
	WWID string
	// Discovery runs SendTargets through the first portal before login.
	Discovery bool
	// Multipath is "auto", "true" or "false" (see KeyMultipath).
	Multipath string
	// Params are per-volume session parameters (Param* keys).
	Params map[string]int

	SessionCHAP   *CHAP
	DiscoveryCHAP *CHAP

	// missingSecrets: CHAP is enabled but no secret was given.
	missingSecrets []string
}

// Key is the canonical identity of the volume's LUN on the node.
func (v *Volume) Key() string { return "iscsi:" + v.IQN + ":" + strconv.Itoa(v.LUN) }

// Identity is the identity of the logical unit as far as the volume_context
// tells it: the WWID when one is given (the attach refuses a LUN reporting
// another, and one logical unit may be exported under several target
// names), else the key. Neither depends on the portals.
func (v *Volume) Identity() string {
	if v.WWID != "" {
		return "iscsi wwid " + v.WWID
	}
	return v.Key()
}

// LogValue describes the volume for logs, without credentials.
func (v *Volume) LogValue() slog.Value {
	ps := make([]string, len(v.Portals))
	for i, p := range v.Portals {
		ps[i] = p.String()
	}
	return slog.GroupValue(
		slog.String("iqn", v.IQN),
		slog.Int("lun", v.LUN),
		slog.String("portals", strings.Join(ps, ",")),
		slog.String("iface", v.Iface),
		slog.String("session_auth", v.SessionCHAP.String()),
		slog.String("discovery_auth", v.DiscoveryCHAP.String()),
	)
}

// ParseVolume validates volume_context (publish_context merged in) and
// secrets. It has no side effects. Secrets are only read when the context
// enables CHAP; nil secrets are fine otherwise (an unstage after a restart
// has none and needs none).
func ParseVolume(volumeContext, secrets map[string]string) (*Volume, error) {
	v := &Volume{Iface: "default", Multipath: "auto"}
	var err error
	if v.IQN, err = ValidateTargetName(KeyIQN, volumeContext[KeyIQN]); err != nil {
		return nil, err
	}

	lun, ok := volumeContext[KeyLUN]
	if !ok {
		return nil, invalid(KeyLUN, "is missing")
	}
	if v.LUN, err = parseIntField(KeyLUN, lun, 0, maxLUN); err != nil {
		return nil, err
	}

	var portals []Portal
	if s, ok := volumeContext[KeyTargetPortal]; ok && strings.TrimSpace(s) != "" {
		p, err := ParsePortal(KeyTargetPortal, s)
		if err != nil {
			return nil, err
		}
		portals = append(portals, p)
	}
	more, err := parsePortalList(KeyPortals, volumeContext[KeyPortals])
	if err != nil {
		return nil, err
	}
	for _, p := range append(portals, more...) {
		if slices.ContainsFunc(v.Portals, func(q Portal) bool { return q.Host == p.Host && q.Port == p.Port }) {
			continue
		}
		// Refused as soon as it is exceeded, the limit also bounds
		// the duplicate check.
		if len(v.Portals) == maxPortals {
			return nil, invalid(KeyPortals, "more than %d distinct portals, at most %d are supported", maxPortals, maxPortals)
		}
		v.Portals = append(v.Portals, p)
	}
	if len(v.Portals) == 0 {
		return nil, invalid(KeyTargetPortal, "no portal given (set targetPortal or portals)")
	}

	if s, ok := volumeContext[KeyInterface]; ok && s != "" {
		if err := checkPrintable(KeyInterface, s); err != nil {
			return nil, err
		}
		if !ifaceRE.MatchString(s) {
			return nil, invalid(KeyInterface, "%q is not an open-iscsi interface name", s)
		}
		v.Iface = s
	}

	if v.WWID, err = validateWWID(KeyWWID, volumeContext[KeyWWID]); err != nil {
		return nil, err
	}

	switch m := strings.ToLower(strings.TrimSpace(volumeContext[KeyMultipath])); m {
	case "", "auto":
	case "true", "false":
		v.Multipath = m
	default:
		return nil, invalid(KeyMultipath, "%q is not true, false or auto", volumeContext[KeyMultipath])
	}

	for name, r := range paramRanges {
		s, ok := volumeContext[name]
		if !ok {
			continue
		}
		n, err := parseIntField(name, s, r[0], r[1])
		if err != nil {
			return nil, err
		}
		if v.Params == nil {
			v.Params = map[string]int{}
		}
		v.Params[name] = n
	}

	sessionAuth, err := parseBoolField(KeySessionCHAPAuth, volumeContext[KeySessionCHAPAuth])
	if err != nil {
		return nil, err
	}
	discoveryAuth, err := parseBoolField(KeyDiscoveryCHAPAuth, volumeContext[KeyDiscoveryCHAPAuth])
	if err != nil {
		return nil, err
	}
	if v.Discovery, err = parseBoolField(KeyDiscovery, volumeContext[KeyDiscovery]); err != nil {
		return nil, err
	}
	if discoveryAuth {
		v.Discovery = true
	}
	// Without any secret (an unstage after a restart re-parses the stored
	// context with none), the volume parses: Detach needs no credentials,
	// and Attach refuses before doing anything.
	if sessionAuth {
		if !anySecret(secrets, SecretSessionUsername, SecretSessionPassword, SecretSessionUsernameIn, SecretSessionPasswordIn) {
			v.missingSecrets = append(v.missingSecrets, SecretSessionUsername, SecretSessionPassword)
		} else if v.SessionCHAP, err = parseCHAP(secrets, SecretSessionUsername, SecretSessionPassword, SecretSessionUsernameIn, SecretSessionPasswordIn); err != nil {
			return nil, err
		}
	}
	if discoveryAuth {
		if !anySecret(secrets, SecretDiscoveryUsername, SecretDiscoveryPassword, SecretDiscoveryUsernameIn, SecretDiscoveryPasswordIn) {
			v.missingSecrets = append(v.missingSecrets, SecretDiscoveryUsername, SecretDiscoveryPassword)
		} else if v.DiscoveryCHAP, err = parseCHAP(secrets, SecretDiscoveryUsername, SecretDiscoveryPassword, SecretDiscoveryUsernameIn, SecretDiscoveryPasswordIn); err != nil {
			return nil, err
		}
	}
	return v, nil
}

func anySecret(secrets map[string]string, keys ...string) bool {
	for _, k := range keys {
		if secrets[k] != "" {
			return true
		}
	}
	return false
}

// CheckSecrets reports the credentials the volume enables CHAP for but was
// parsed without: Attach needs them, Detach does not.
func (v *Volume) CheckSecrets() error {
	if len(v.missingSecrets) == 0 {
		return nil
	}
	return fmt.Errorf("CHAP is enabled (%s/%s) but the request has no secrets %q: give them in the node-stage secret: %w",
		KeySessionCHAPAuth, KeyDiscoveryCHAPAuth, v.missingSecrets, errdefs.ErrInvalidArgument)
}

func parseIntField(field, s string, lo, hi int) (int, error) {
	if err := checkPrintable(field, s); err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, invalid(field, "%q is not an integer", s)
	}
	if n < lo || n > hi {
		return 0, invalid(field, "%d is out of range %d-%d", n, lo, hi)
	}
	return n, nil
}

func parseBoolField(field, s string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "false", "no", "0":
		return false, nil
	case "true", "yes", "1":
		return true, nil
	}
	if err := checkPrintable(field, s); err != nil {
		return false, err
	}
	return false, invalid(field, "%q is not true or false", s)
}

// parseCHAP reads one set of credentials. Errors name the secret key, never
// its value.
func parseCHAP(secrets map[string]string, user, pass, userIn, passIn string) (*CHAP, error) {
	c := &CHAP{
		Username: secrets[user], Password: secrets[pass],
		UsernameIn: secrets[userIn], PasswordIn: secrets[passIn],
	}
	for _, kv := range [][2]string{{user, c.Username}, {pass, c.Password}, {userIn, c.UsernameIn}, {passIn, c.PasswordIn}} {
		if err := checkSecret(kv[0], kv[1]); err != nil {
			return nil, err
		}
	}
	if c.Username == "" || c.Password == "" {
		return nil, fmt.Errorf("secrets %q and %q are required when CHAP is enabled: %w", user, pass, errdefs.ErrInvalidArgument)
	}
	if (c.UsernameIn == "") != (c.PasswordIn == "") {
		return nil, fmt.Errorf("secrets %q and %q must be given together for mutual CHAP: %w", userIn, passIn, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

// checkSecret enforces what open-iscsi's line-based record files can hold:
// no control characters, no leading or trailing blanks, at most 255 bytes.
func checkSecret(key, v string) error {
	if v == "" {
		return nil
	}
	bad := func(why string) error {
		return fmt.Errorf("secret %q %s: %w", key, why, errdefs.ErrInvalidArgument)
	}
	if len(v) > maxCHAPLen {
		return bad(fmt.Sprintf("is longer than %d bytes", maxCHAPLen))
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return bad("contains a control character")
		}
	}
	if strings.TrimSpace(v) != v {
		return bad("starts or ends with a blank")
	}
	return nil
}
