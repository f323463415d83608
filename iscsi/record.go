package iscsi

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
)

// open-iscsi keeps one text record per target, portal and interface:
//
//	<nodes>/<target>/<address>,<port>,<tpgt>/<iface>   (current layout)
//	<nodes>/<target>/<address>,<port>                   (pre-2007 layout)
//
// and one per SendTargets discovery portal:
//
//	<send_targets>/<address>,<port>/st_config
//
// Each line is "name = value"; lines starting with '#' are comments. The
// reader (idbm_recinfo_config) takes everything after "= " up to the end of
// the line, so a value may hold any printable character except leading or
// trailing blanks, which it strips. A password's length field is derived
// from the password when the record is read.
//
// CHAP secrets are written into these files by berth itself rather than
// through `iscsiadm -o update -v SECRET`, whose argument vector any process
// on the node can read in /proc/<pid>/cmdline.

const (
	recordBegin = "# BEGIN RECORD"
	recordEnd   = "# END RECORD"
)

// setting is one "name = value" line of a record.
type setting struct{ name, value string }

// setRecordValues returns rec with each setting replacing the line of the
// same name, or inserted before "# END RECORD" (at the end when there is
// none). Other lines are kept as they are.
func setRecordValues(rec []byte, set []setting) ([]byte, error) {
	for _, s := range set {
		if strings.ContainsAny(s.name, " =\n\r\x00") || s.name == "" {
			return nil, fmt.Errorf("record key %q: %w", s.name, errdefs.ErrInvalidArgument)
		}
		if strings.ContainsAny(s.value, "\n\r\x00") || strings.TrimSpace(s.value) != s.value || s.value == "" {
			// The value itself is never quoted: it may be a secret.
			return nil, fmt.Errorf("record key %q: value is empty, multi-line or has outer blanks: %w", s.name, errdefs.ErrInvalidArgument)
		}
	}
	pending := make(map[string]string, len(set))
	for _, s := range set {
		pending[s.name] = s.value
	}
	var out bytes.Buffer
	sc := bufio.NewScanner(bytes.NewReader(rec))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	appendPending := func() {
		for _, s := range set {
			if v, ok := pending[s.name]; ok {
				fmt.Fprintf(&out, "%s = %s\n", s.name, v)
				delete(pending, s.name)
			}
		}
	}
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, recordEnd) {
			appendPending()
			out.WriteString(line + "\n")
			continue
		}
		if name, ok := recordKey(trimmed); ok {
			if v, ok := pending[name]; ok {
				fmt.Fprintf(&out, "%s = %s\n", name, v)
				delete(pending, name)
				continue
			}
			if _, ok := findSetting(set, name); ok {
				continue // a duplicate of a line already replaced
			}
		}
		out.WriteString(line + "\n")
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read record: %w", err)
	}
	appendPending()
	return out.Bytes(), nil
}

func findSetting(set []setting, name string) (string, bool) {
	for _, s := range set {
		if s.name == name {
			return s.value, true
		}
	}
	return "", false
}

// recordKey returns the name of a "name = value" line.
func recordKey(line string) (string, bool) {
	if line == "" || line[0] == '#' {
		return "", false
	}
	i := strings.IndexAny(line, " \t=")
	if i <= 0 {
		return "", false
	}
	return line[:i], true
}

// recordDB is open-iscsi's record database on the node.
type recordDB struct {
	// nodes is the node record directory; "" = the first existing of
	// defaultNodeDirs.
	nodes string
	// lockDir holds open-iscsi's database lock ("lock", "lock.write").
	lockDir string
	// walks orders berth's own record changes against the iscsiadm
	// commands of the node's berths (see recordsRunner); nil in tests of
	// the file format alone.
	walks *recordWalks
}

// defaultNodeDirs are where distributions keep node records: Debian and
// Ubuntu under /etc/iscsi, Fedora, RHEL and SUSE under /var/lib/iscsi.
var defaultNodeDirs = []string{"/etc/iscsi/nodes", "/var/lib/iscsi/nodes"}

func (db *recordDB) nodeDir() (string, error) {
	if db.nodes != "" {
		return db.nodes, nil
	}
	for _, d := range defaultNodeDirs {
		if st, err := os.Stat(d); err == nil && st.IsDir() {
			return d, nil
		}
	}
	return "", errdefs.Unavailable("no open-iscsi node record directory (%s): is open-iscsi installed, and /etc/iscsi and /var/lib/iscsi mounted from the host? (--iscsi-node-dir names it)", strings.Join(defaultNodeDirs, ", "))
}

// sendTargetsDir finds the discovery record directory, next to the node
// records. It exists once iscsiadm created a discovery record.
func (db *recordDB) sendTargetsDir() (string, error) {
	if db.nodes != "" {
		return filepath.Join(filepath.Dir(db.nodes), "send_targets"), nil
	}
	for _, d := range defaultNodeDirs {
		st := filepath.Join(filepath.Dir(d), "send_targets")
		if fi, err := os.Stat(st); err == nil && fi.IsDir() {
			return st, nil
		}
	}
	return "", errdefs.Unavailable("no open-iscsi discovery record directory (send_targets next to %s): is open-iscsi installed, and /etc/iscsi and /var/lib/iscsi mounted from the host?", strings.Join(defaultNodeDirs, ", "))
}

// nodeRecordFiles returns the record files of target at address:port for
// iface, in either layout. ErrNotFound when there is none.
func (db *recordDB) nodeRecordFiles(target, address string, port int, iface string) ([]string, error) {
	dir, err := db.nodeDir()
	if err != nil {
		return nil, err
	}
	base := filepath.Join(dir, target, address+","+strconv.Itoa(port))
	if st, err := os.Stat(base); err == nil && st.Mode().IsRegular() {
		return []string{base}, nil
	}
	matches, err := filepath.Glob(globEscape(base) + ",*")
	if err != nil {
		return nil, err
	}
	var files []string
	for _, m := range matches {
		f := filepath.Join(m, iface)
		if st, err := os.Stat(f); err == nil && st.Mode().IsRegular() {
			files = append(files, f)
		}
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("node record %s,%d for %s (iface %s) in %s: %w", address, port, target, iface, dir, errdefs.ErrNotFound)
	}
	return files, nil
}

// globEscape quotes the glob metacharacters of a path (IPv6 addresses have
// none, but target names may contain '[').
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// update rewrites the record files with set, holding open-iscsi's database
// lock. The files are replaced atomically and left readable by root only.
func (db *recordDB) update(ctx context.Context, files []string, set []setting) error {
	unlock, err := db.lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	for _, f := range files {
		if err := rewriteFile(f, func(b []byte) ([]byte, error) { return setRecordValues(b, set) }); err != nil {
			return err
		}
	}
	return nil
}

// rewriteFile edits a record in place, as iscsiadm does, under the
// database lock that iscsiadm also takes to read. The mode is set to 0600
// before the new content (which may hold secrets) is written.
func rewriteFile(path string, edit func([]byte) ([]byte, error)) error {
	old, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read record %s: %w", path, err)
	}
	b, err := edit(old)
	if err != nil {
		return fmt.Errorf("record %s: %w", path, err)
	}
	if err := writeRecord(path, b); err != nil {
		return fmt.Errorf("write record %s: %w", path, err)
	}
	return nil
}

// lock takes open-iscsi's database lock the way iscsiadm does: a hard link
// of "lock" to "lock.write" that only one process can create. iscsiadm
// holds it for milliseconds, so the wait is capped at lockWait.
func (db *recordDB) lock(ctx context.Context) (func(), error) {
	if db.walks != nil {
		release, err := db.walks.hold(true)
		if err != nil {
			return nil, err
		}
		unlock, err := db.fileLock(ctx)
		if err != nil {
			release()
			return nil, err
		}
		return func() { unlock(); release() }, nil
	}
	return db.fileLock(ctx)
}

func (db *recordDB) fileLock(ctx context.Context) (func(), error) {
	dir := db.lockDir
	if dir == "" {
		dir = defaultLockDir
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("open-iscsi lock directory %s: %w", dir, err)
	}
	lockFile := filepath.Join(dir, "lock")
	writeFile := filepath.Join(dir, "lock.write")
	if f, err := os.OpenFile(lockFile, os.O_RDWR|os.O_CREATE, 0o600); err == nil {
		f.Close()
	}
	deadline := time.NewTimer(lockWait)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		err := os.Link(lockFile, writeFile)
		if err == nil {
			return func() { os.Remove(writeFile) }, nil
		}
		if !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("lock open-iscsi records (%s): %w", writeFile, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("lock open-iscsi records (%s): %w", writeFile, ctx.Err())
		case <-deadline.C:
			return nil, fmt.Errorf("open-iscsi record lock %s held for more than %s; remove it if no iscsiadm is running: %w", writeFile, lockWait, errdefs.ErrBusy)
		case <-tick.C:
		}
	}
}

// defaultLockDir is open-iscsi's lock directory.
const defaultLockDir = "/run/lock/iscsi"

// lockWait bounds the wait for open-iscsi's database lock.
const lockWait = 10 * time.Second

// writeRecord writes a record file, new or not, mode 0600 before any
// content.
func writeRecord(file string, rec []byte) error {
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Chmod(0o600); err != nil {
		return err
	}
	if _, err := f.Write(rec); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}
