// Package keyring reaches the kernel's key retention service: the
// keyrings /proc/keys lists, and adding, searching, reading and
// unlinking keys of one keyring as its possessor. NVMe/TCP keeps its TLS
// pre-shared keys in the kernel's .nvme keyring.
package keyring

import (
	"bufio"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Key is one line of /proc/keys.
type Key struct {
	Serial      int
	Type        string
	Description string // without the summary the key type appends
	Perm        uint32
	UID, GID    int
}

// Find returns the serial of the keyring called name among keys (as
// List returns them), or errdefs.ErrNotFound.
func Find(keys []Key, name string) (int, error) {
	for _, k := range keys {
		if k.Type == "keyring" && k.Description == name {
			return k.Serial, nil
		}
	}
	return 0, fmt.Errorf("keyring %s: not in %s: %w", name, ProcKeys, errdefs.ErrNotFound)
}

// ParseProcKeys parses /proc/keys:
//
//	334e6aca I--Q---     1 perm 3b010000     0     0 psk       NVMe0R01 nqn... nqn...: 32
//
// serial (hex), flags, usage, expiry, permissions (hex), uid, gid, type
// (cut to 9 characters), then the description followed by the type's
// summary: ": <n>" for keyrings ("empty" when they have no link) and for
// keys of the user-like types such as psk. The summary is cut at the
// last ": "; descriptions of NVMe keys hold colons, never ": ".
func ParseProcKeys(r io.Reader) ([]Key, error) {
	var keys []Key
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		if len(f) < 9 {
			return nil, fmt.Errorf("/proc/keys line %d: %d fields, want at least 9", n, len(f))
		}
		serial, err := strconv.ParseUint(f[0], 16, 31)
		if err != nil {
			return nil, fmt.Errorf("/proc/keys line %d: serial %q: %w", n, f[0], err)
		}
		perm, err := strconv.ParseUint(f[4], 16, 32)
		if err != nil {
			return nil, fmt.Errorf("/proc/keys line %d: permissions %q: %w", n, f[4], err)
		}
		uid, err1 := strconv.Atoi(f[5])
		gid, err2 := strconv.Atoi(f[6])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("/proc/keys line %d: owner %q %q: not numbers", n, f[5], f[6])
		}
		// The description is the rest of the line after the type
		// column, as printed (white space inside it kept).
		line := sc.Text()
		rest := line
		for i := 0; i < 8; i++ {
			rest = strings.TrimLeft(rest, " ")
			j := strings.IndexByte(rest, ' ')
			if j < 0 {
				rest = ""
				break
			}
			rest = rest[j:]
		}
		desc := strings.TrimLeft(rest, " ")
		if i := strings.LastIndex(desc, ": "); i >= 0 {
			desc = desc[:i]
		}
		keys = append(keys, Key{Serial: int(serial), Type: f[7], Description: desc, Perm: uint32(perm), UID: uid, GID: gid})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read /proc/keys: %w", err)
	}
	return keys, nil
}

// parseDescribe parses KEYCTL_DESCRIBE's "type;uid;gid;perm;description"
// (perm in hex; the description may hold semicolons).
func parseDescribe(s string) (Key, bool) {
	f := strings.SplitN(strings.TrimRight(s, "\x00"), ";", 5)
	if len(f) != 5 {
		return Key{}, false
	}
	uid, err1 := strconv.Atoi(f[1])
	gid, err2 := strconv.Atoi(f[2])
	perm, err3 := strconv.ParseUint(f[3], 16, 32)
	if err1 != nil || err2 != nil || err3 != nil {
		return Key{}, false
	}
	return Key{Type: f[0], UID: uid, GID: gid, Perm: uint32(perm), Description: f[4]}, true
}
