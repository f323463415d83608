package fs

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Linux mount(2) flags. They are kernel ABI; declared here so that option
// parsing builds and is tested on every OS (a Linux test checks them
// against x/sys/unix).
const (
	MS_RDONLY      uintptr = 0x1
	MS_NOSUID      uintptr = 0x2
	MS_NODEV       uintptr = 0x4
	MS_NOEXEC      uintptr = 0x8
	MS_SYNCHRONOUS uintptr = 0x10
	MS_REMOUNT     uintptr = 0x20
	MS_DIRSYNC     uintptr = 0x80
	MS_NOATIME     uintptr = 0x400
	MS_NODIRATIME  uintptr = 0x800
	MS_BIND        uintptr = 0x1000
	MS_RELATIME    uintptr = 0x200000
	MS_STRICTATIME uintptr = 0x1000000
	MS_LAZYTIME    uintptr = 0x2000000
)

const atimeFlags = MS_NOATIME | MS_RELATIME | MS_STRICTATIME

// flagOption is a mount option that maps to mount(2) flags.
type flagOption struct{ set, clear uintptr }

var flagOptions = map[string]flagOption{
	"defaults":    {},
	"ro":          {set: MS_RDONLY},
	"rw":          {clear: MS_RDONLY},
	"nosuid":      {set: MS_NOSUID},
	"suid":        {clear: MS_NOSUID},
	"nodev":       {set: MS_NODEV},
	"dev":         {clear: MS_NODEV},
	"noexec":      {set: MS_NOEXEC},
	"exec":        {clear: MS_NOEXEC},
	"sync":        {set: MS_SYNCHRONOUS},
	"async":       {clear: MS_SYNCHRONOUS},
	"dirsync":     {set: MS_DIRSYNC},
	"noatime":     {set: MS_NOATIME, clear: atimeFlags &^ MS_NOATIME},
	"relatime":    {set: MS_RELATIME, clear: atimeFlags &^ MS_RELATIME},
	"strictatime": {set: MS_STRICTATIME, clear: atimeFlags &^ MS_STRICTATIME},
	"nodiratime":  {set: MS_NODIRATIME},
	"diratime":    {clear: MS_NODIRATIME},
	"lazytime":    {set: MS_LAZYTIME},
	"nolazytime":  {clear: MS_LAZYTIME},
}

// dataOptions are passed to the filesystem verbatim (ext4 and xfs).
var dataOptions = map[string]bool{
	"discard": true, "nodiscard": true,
	"barrier": true,
	"acl":     true, "user_xattr": true,
	"auto_da_alloc": true, "noauto_da_alloc": true,
	"journal_checksum": true, "block_validity": true,
	"grpid": true, "bsdgroups": true, "nogrpid": true, "sysvgroups": true,
	"inode64": true, "inode32": true, "nouuid": true,
	"largeio": true, "nolargeio": true, "swalloc": true, "wsync": true,
	"quota": true, "noquota": true, "usrquota": true, "grpquota": true, "prjquota": true,
	"uquota": true, "gquota": true, "pquota": true,
}

// valueOptions are key=value options passed to the filesystem, with the
// check their value must pass.
var valueOptions = map[string]func(v string) error{
	"errors":               oneOf("remount-ro", "continue"),
	"data":                 oneOf("ordered", "journal"),
	"commit":               uintRange(0, 86400),
	"stripe":               uintRange(0, 1<<31),
	"max_batch_time":       uintRange(0, 1<<31),
	"min_batch_time":       uintRange(0, 1<<31),
	"journal_ioprio":       uintRange(0, 7),
	"inode_readahead_blks": uintRange(0, 1<<31),
	"barrier":              oneOf("1"),
	"logbufs":              uintRange(2, 8),
	"logbsize":             size,
	"allocsize":            size,
	"context":              selinuxContext,
	"fscontext":            selinuxContext,
	"defcontext":           selinuxContext,
	"rootcontext":          selinuxContext,
}

// refused names options that are understood but never allowed, with why.
var refused = map[string]string{
	"nobarrier":      "disables write barriers (data loss on power failure)",
	"barrier=0":      "disables write barriers (data loss on power failure)",
	"norecovery":     "skips log/journal recovery (mounts an inconsistent filesystem)",
	"noload":         "skips journal recovery (mounts an inconsistent filesystem)",
	"data=writeback": "may expose stale data after a crash",
	"errors=panic":   "panics the node on a filesystem error",
	"dax":            "changes I/O semantics of the volume",
	"mand":           "mandatory locking is removed from Linux",
	"bind":           "bind mounts are made by the publish step",
	"rbind":          "bind mounts are made by the publish step",
	"remount":        "remounts are made by berth itself",
	"move":           "not a filesystem option",
	"loop":           "not a mount(2) option",
}

// ParseMountOptions validates user mount options (one option per element,
// as in CSI mount_flags) against an allowlist and splits them into
// mount(2) flags and the filesystem data string. Later flag options win
// over earlier ones ("ro","rw" is read-write). An unknown or refused
// option returns an error wrapping errdefs.ErrInvalidArgument that names
// it. Commas are refused except inside a double-quoted SELinux context
// value (`context="system_u:object_r:container_file_t:s0:c1,c2"`).
func ParseMountOptions(opts []string) (flags uintptr, data string, err error) {
	var parts []string
	for _, o := range opts {
		part, fo, isFlag, err := parseOption(o)
		if err != nil {
			return 0, "", err
		}
		if isFlag {
			flags = flags&^fo.clear | fo.set
			continue
		}
		parts = append(parts, part)
	}
	return flags, strings.Join(parts, ","), nil
}

func invalidOption(o, why string) error {
	return fmt.Errorf("mount option %q: %s: %w", o, why, errdefs.ErrInvalidArgument)
}

// parseOption checks one option and returns either its flags or its
// normalised data form.
func parseOption(o string) (data string, fo flagOption, isFlag bool, err error) {
	switch {
	case o == "":
		return "", fo, false, invalidOption(o, "empty option")
	case len(o) > 512:
		return "", fo, false, invalidOption(o[:32]+"...", "longer than 512 bytes")
	case strings.ContainsFunc(o, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return "", fo, false, invalidOption(o, "contains NUL, newline or another control character")
	case strings.ContainsAny(o, " \t\\'"):
		return "", fo, false, invalidOption(o, "contains whitespace, a backslash or a quote")
	}
	if why, ok := refused[o]; ok {
		return "", fo, false, invalidOption(o, "refused: "+why)
	}
	if f, ok := flagOptions[o]; ok {
		return "", f, true, nil
	}
	if dataOptions[o] {
		return o, fo, false, nil
	}
	key, val, hasVal := strings.Cut(o, "=")
	check, ok := valueOptions[key]
	if !ok || !hasVal {
		if strings.Contains(o, ",") {
			return "", fo, false, invalidOption(o, "contains a comma; pass one option per element")
		}
		if _, isKV := valueOptions[key]; isKV {
			return "", fo, false, invalidOption(o, "needs a value ("+key+"=...)")
		}
		return "", fo, false, invalidOption(o, "not an allowed mount option")
	}
	if strings.HasSuffix(key, "context") {
		// An MLS category list has commas; the kernel reads it inside
		// double quotes.
		unq := strings.TrimSuffix(strings.TrimPrefix(val, `"`), `"`)
		if len(unq)+2 != len(val) && unq != val {
			return "", fo, false, invalidOption(o, "unbalanced double quote")
		}
		if strings.Contains(val, ",") && unq == val {
			return "", fo, false, invalidOption(o, "a context with commas must be in double quotes")
		}
		if err := check(unq); err != nil {
			return "", fo, false, invalidOption(o, err.Error())
		}
		if strings.Contains(unq, ",") {
			return key + `="` + unq + `"`, fo, false, nil
		}
		return key + "=" + unq, fo, false, nil
	}
	if strings.ContainsAny(val, `,"=`) {
		return "", fo, false, invalidOption(o, "value contains a comma, a quote or '='")
	}
	if err := check(val); err != nil {
		if why, ok := refused[o]; ok {
			return "", fo, false, invalidOption(o, "refused: "+why)
		}
		return "", fo, false, invalidOption(o, err.Error())
	}
	return o, fo, false, nil
}

func oneOf(allowed ...string) func(string) error {
	return func(v string) error {
		for _, a := range allowed {
			if v == a {
				return nil
			}
		}
		return fmt.Errorf("value %q not one of %s", v, strings.Join(allowed, ", "))
	}
}

func uintRange(lo, hi uint64) func(string) error {
	return func(v string) error {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n < lo || n > hi {
			return fmt.Errorf("value %q is not an integer in [%d, %d]", v, lo, hi)
		}
		return nil
	}
}

var sizeRE = regexp.MustCompile(`^[0-9]{1,12}[kKmMgG]?$`)

func size(v string) error {
	if !sizeRE.MatchString(v) {
		return fmt.Errorf("value %q is not a size (digits with optional k, m or g)", v)
	}
	return nil
}

// selinuxRE matches user:role:type[:sensitivity[-sensitivity]] where a
// sensitivity is sN with an optional category set cN[.cM][,cN...].
var selinuxRE = regexp.MustCompile(`^[A-Za-z0-9_.]+:[A-Za-z0-9_.]+:[A-Za-z0-9_.]+` +
	`(:s[0-9]+(:c[0-9]+(\.c[0-9]+)?(,c[0-9]+(\.c[0-9]+)?)*)?(-s[0-9]+(:c[0-9]+(\.c[0-9]+)?(,c[0-9]+(\.c[0-9]+)?)*)?)?)?$`)

func selinuxContext(v string) error {
	if len(v) > 255 || !selinuxRE.MatchString(v) {
		return fmt.Errorf("value %q is not an SELinux context (user:role:type[:level])", v)
	}
	return nil
}
