package target

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

var modMu sync.Mutex

// LoadModules loads kernel modules (and their dependencies) with modprobe.
func LoadModules(t testing.TB, names ...string) {
	t.Helper()
	modMu.Lock()
	defer modMu.Unlock()
	out, err := exec.Command("modprobe", append([]string{"-a"}, names...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("modprobe %s: %v: %s", strings.Join(names, " "), err, out)
	}
}

// writeAttr writes a configfs or sysfs attribute.
func writeAttr(path, value string) error {
	if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
		return fmt.Errorf("write %q to %s: %w", value, path, err)
	}
	return nil
}

func mustWrite(t testing.TB, path, value string) {
	t.Helper()
	if err := writeAttr(path, value); err != nil {
		t.Fatal(err)
	}
}

func mustMkdir(t testing.TB, path string) {
	t.Helper()
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatalf("mkdir %s: %v", path, err)
	}
}

func mustSymlink(t testing.TB, oldname, newname string) {
	t.Helper()
	if err := os.Symlink(oldname, newname); err != nil {
		t.Fatalf("symlink %s -> %s: %v", newname, oldname, err)
	}
}

// rmdir removes a configfs directory (configfs wants rmdir, not unlinking
// its attribute files); a missing one is fine.
func rmdir(t testing.TB, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		t.Errorf("cleanup: rmdir %s: %v", path, err)
	}
}

// unlinkAll removes the symlinks in dir.
func unlinkAll(t testing.TB, dir string) {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.Type()&os.ModeSymlink != 0 {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				t.Errorf("cleanup: unlink %s: %v", filepath.Join(dir, e.Name()), err)
			}
		}
	}
}

// stableID derives 16 bytes from a name, for identities that must not change
// between runs.
func stableID(parts ...string) [16]byte {
	sum := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	var id [16]byte
	copy(id[:], sum[:16])
	id[6] = id[6]&0x0f | 0x40 // version 4 layout
	id[8] = id[8]&0x3f | 0x80
	return id
}

func formatUUID(id [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", id[0:4], id[4:6], id[6:8], id[8:10], id[10:16])
}

var seqMu sync.Mutex
var seq = map[string]int{}

func next(kind string) int {
	seqMu.Lock()
	defer seqMu.Unlock()
	seq[kind]++
	return seq[kind]
}
