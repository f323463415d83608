package iscsi

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"unicode"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// DefaultPort is the IANA port of iSCSI, used when a portal names none.
const DefaultPort = 3260

// maxNameLen is the longest iSCSI name RFC 3720 allows (223 bytes).
const maxNameLen = 223

var (
	// iqn.YYYY-MM.reversed.domain[:anything]. The naming authority is a
	// reversed DNS name; the optional part after the colon is free-form
	// but restricted to the characters RFC 3722 stringprep leaves.
	iqnRE = regexp.MustCompile(`^iqn\.[0-9]{4}-(0[1-9]|1[0-2])\.[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*(:[a-z0-9.:_-]+)?$`)
	euiRE = regexp.MustCompile(`^eui\.[0-9a-f]{16}$`)
	naaRE = regexp.MustCompile(`^naa\.([0-9a-f]{16}|[0-9a-f]{32})$`)
	// Interface names are file names in open-iscsi's iface database.
	ifaceRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$`)
	// A DNS host name (RFC 1123 labels).
	hostRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$`)
)

// invalid returns an ErrInvalidArgument naming the volume_context field.
func invalid(field, format string, args ...any) error {
	return errdefs.InvalidArgument("volume_context %q: %s", field, fmt.Sprintf(format, args...))
}

// checkPrintable rejects control characters and non-ASCII spaces: every
// value ends up in a command argument, a sysfs file or open-iscsi's record
// files, which are line based.
func checkPrintable(field, v string) error {
	for i, r := range v {
		if r == unicode.ReplacementChar || unicode.IsControl(r) || (unicode.IsSpace(r) && r != ' ') {
			return invalid(field, "contains a control character at byte %d", i)
		}
	}
	return nil
}

// ValidateTargetName checks an iSCSI target name in one of the three formats
// of RFC 3720 section 3.2.6.3 (iqn., eui., naa.). Names are compared in
// lower case by iSCSI; the name is returned lower-cased.
func ValidateTargetName(field, name string) (string, error) {
	n, problem := checkISCSIName(name)
	if problem != "" {
		return "", invalid(field, "%s", problem)
	}
	return n, nil
}

// checkISCSIName checks an iSCSI name (a target's or an initiator's) and
// returns it lower-cased, or what is wrong with it.
func checkISCSIName(name string) (string, string) {
	if name == "" {
		return "", "is empty"
	}
	for i, r := range name {
		if r == unicode.ReplacementChar || unicode.IsControl(r) || (unicode.IsSpace(r) && r != ' ') {
			return "", fmt.Sprintf("contains a control character at byte %d", i)
		}
	}
	if len(name) > maxNameLen {
		return "", fmt.Sprintf("is %d bytes long, iSCSI names have at most %d", len(name), maxNameLen)
	}
	n := strings.ToLower(name)
	switch {
	case strings.HasPrefix(n, "iqn."):
		if !iqnRE.MatchString(n) {
			return "", fmt.Sprintf("%q is not an iqn name (iqn.YYYY-MM.reversed.domain[:identifier])", name)
		}
	case strings.HasPrefix(n, "eui."):
		if !euiRE.MatchString(n) {
			return "", fmt.Sprintf("%q is not an eui name (eui. and 16 hex digits)", name)
		}
	case strings.HasPrefix(n, "naa."):
		if !naaRE.MatchString(n) {
			return "", fmt.Sprintf("%q is not an naa name (naa. and 16 or 32 hex digits)", name)
		}
	default:
		return "", fmt.Sprintf("%q does not start with iqn., eui. or naa.", name)
	}
	return n, ""
}

// Portal is one iSCSI network portal of a volume.
type Portal struct {
	// Host is the address or DNS name as the volume gives it.
	Host string
	// Port is the TCP port.
	Port int
	// TPGT is the target portal group tag, -1 when not given.
	TPGT int
}

// String returns host:port[,tpgt], bracketing IPv6 literals.
func (p Portal) String() string {
	s := net.JoinHostPort(p.Host, strconv.Itoa(p.Port))
	if p.TPGT >= 0 {
		s += "," + strconv.Itoa(p.TPGT)
	}
	return s
}

// ParsePortal parses "host", "host:port", "[v6]:port" or any of those with
// ",tpgt" appended, the forms iscsiadm -p accepts.
func ParsePortal(field, s string) (Portal, error) {
	if err := checkPrintable(field, s); err != nil {
		return Portal{}, err
	}
	s = strings.TrimSpace(s)
	if s == "" {
		return Portal{}, invalid(field, "portal is empty")
	}
	p := Portal{Port: DefaultPort, TPGT: -1}
	if i := strings.LastIndexByte(s, ','); i >= 0 {
		t, err := strconv.Atoi(s[i+1:])
		if err != nil || t < 0 || t > 65535 {
			return Portal{}, invalid(field, "portal %q: portal group tag %q is not a number 0-65535", s, s[i+1:])
		}
		p.TPGT = t
		s = s[:i]
	}
	host := s
	if h, port, err := net.SplitHostPort(s); err == nil {
		n, err := strconv.Atoi(port)
		if err != nil || n < 1 || n > 65535 {
			return Portal{}, invalid(field, "portal %q: port %q is not a number 1-65535", s, port)
		}
		host, p.Port = h, n
	} else if strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]") {
		host = s[1 : len(s)-1]
	} else if strings.Count(s, ":") == 1 {
		return Portal{}, invalid(field, "portal %q: %v", s, err)
	}
	if host == "" {
		return Portal{}, invalid(field, "portal %q has no host", s)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return Portal{}, invalid(field, "portal %q: zoned IPv6 addresses are not supported", s)
		}
		p.Host = a.Unmap().String()
		return p, nil
	}
	if strings.Contains(host, ":") || !hostRE.MatchString(host) || len(host) > 253 {
		return Portal{}, invalid(field, "portal %q: %q is neither an IP address nor a DNS name", s, host)
	}
	p.Host = strings.ToLower(strings.TrimSuffix(host, "."))
	return p, nil
}

// parsePortalList accepts csi-driver-iscsi's `["ip:port","ip:port"]` form,
// a bare comma or space separated list, and the empty string.
func parsePortalList(field, s string) ([]Portal, error) {
	if err := checkPrintable(field, s); err != nil {
		return nil, err
	}
	s = strings.TrimSpace(s)
	if strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]") && !looksLikeBracketedV6(s) {
		s = s[1 : len(s)-1]
	}
	var out []Portal
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == ';' || r == '\t' }) {
		// A comma separates list entries unless it introduces a tpgt
		// (",N" after a port); split on commas followed by a non-digit.
		for _, item := range splitPortalItems(f) {
			item = strings.Trim(item, `"'`)
			if item == "" {
				continue
			}
			p, err := ParsePortal(field, item)
			if err != nil {
				return nil, err
			}
			out = append(out, p)
		}
	}
	return out, nil
}

// looksLikeBracketedV6 tells "[fd00::1]:3260" (one portal) from a list.
func looksLikeBracketedV6(s string) bool {
	inner := s[1 : len(s)-1]
	if strings.ContainsAny(inner, `"',`) {
		return false
	}
	_, err := netip.ParseAddr(inner)
	return err == nil
}

// splitPortalItems splits "a:1,b:2" into items but keeps "a:1,1" (a tpgt)
// together: a comma followed only by digits up to the next comma or the
// end, right after a port, is a tpgt.
func splitPortalItems(s string) []string {
	parts := strings.Split(s, ",")
	var out []string
	for i := 0; i < len(parts); i++ {
		cur := parts[i]
		if i+1 < len(parts) && isDigits(strings.Trim(parts[i+1], `"'`)) && hasPort(strings.Trim(cur, `"'`)) {
			cur += "," + parts[i+1]
			i++
		}
		out = append(out, cur)
	}
	return out
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

func hasPort(s string) bool {
	_, _, err := net.SplitHostPort(s)
	return err == nil
}

// validateWWID accepts kernel (naa./eui./t10.), multipath ("3...") and
// SCSI name forms.
func validateWWID(field, w string) (string, error) {
	if err := checkPrintable(field, w); err != nil {
		return "", err
	}
	w = strings.TrimSpace(w)
	if w == "" {
		return "", nil
	}
	if len(w) > 256 {
		return "", invalid(field, "is longer than 256 bytes")
	}
	return devices.NormalizeWWID(w), nil
}

// ErrNameNotGenerated says initiatorname.iscsi asks for a generated
// name that iscsid has not written yet (it does so when it starts).
var ErrNameNotGenerated = fmt.Errorf("iscsid has not written the generated name yet: %w", errdefs.ErrFailedPrecondition)

// ReadInitiatorName reads the node's initiator name from open-iscsi's
// initiatorname.iscsi (its InitiatorName= line) and checks it as berth
// checks target names. It is the one reading of that file: the login
// preflight and berth doctor both use it. The error says what is wrong:
// the file is missing or unreadable, it asks for a generated name that
// iscsid has not written yet, it has no name, or the name is not valid.
func ReadInitiatorName(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("cannot read %s: %w", path, err)
	}
	var name string
	generate := false
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if v, ok := strings.CutPrefix(line, "InitiatorName="); ok {
			name = strings.TrimSpace(v)
		}
		if strings.HasPrefix(line, "GenerateName=") {
			generate = true
		}
	}
	switch {
	case name == "" && generate:
		return "", fmt.Errorf("%s asks for a generated name (GenerateName=yes): %w", path, ErrNameNotGenerated)
	case name == "":
		return "", fmt.Errorf("%s has no InitiatorName= line: %w", path, errdefs.ErrFailedPrecondition)
	}
	if _, problem := checkISCSIName(name); problem != "" {
		return "", fmt.Errorf("%s: InitiatorName %s: %w", path, problem, errdefs.ErrFailedPrecondition)
	}
	return name, nil
}
