package devices

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

// fakeSys loads the saved sysfs tree testdata/sysfs.txt and returns it
// with the Roots of it (sysfs, /dev and /run/udev). A listener on it takes
// device nodes to exist (anyNode).
func fakeSys(t *testing.T) (*sysfstest.Tree, Roots) {
	t.Helper()
	sys := sysfstest.New(t)
	sys.Load(filepath.Join("testdata", "sysfs.txt"))
	root := t.TempDir()
	return sys, Roots{Sys: sys.Root(), Dev: filepath.Join(root, "dev"), UdevRun: filepath.Join(root, "run-udev")}
}

// anyNode stands in for the device node check on fake trees, which have no
// nodes.
func anyNode(*Device) bool { return true }

// writeFile writes a file below dir (udev's, not sysfs), creating parents.
func writeFile(t *testing.T, dir, rel, content string) {
	t.Helper()
	p := filepath.Join(dir, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
