package devices

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/sysfs"
)

// fakeSys builds the sysfs tree described by testdata/<spec> in a temporary
// directory and returns the Roots of it (sysfs, /dev and /run/udev). A
// listener on it takes device nodes to exist (anyNode).
func fakeSys(t *testing.T, spec string) Roots {
	t.Helper()
	root := t.TempDir()
	sys := filepath.Join(root, "sys")
	f, err := os.Open(filepath.Join("testdata", spec))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		op, rest, _ := strings.Cut(line, " ")
		path, arg, _ := strings.Cut(rest, " ")
		p := filepath.Join(sys, path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		switch op {
		case "f":
			err = os.WriteFile(p, []byte(strings.ReplaceAll(arg, `\n`, "\n")+"\n"), 0o644)
		case "l":
			err = os.Symlink(arg, p)
		case "b":
			var b []byte
			if b, err = os.ReadFile(filepath.Join("testdata", arg)); err == nil {
				err = os.WriteFile(p, b, 0o444)
			}
		case "d":
			err = os.MkdirAll(p, 0o755)
		default:
			t.Fatalf("%s:%d: unknown op %q", spec, n, op)
		}
		if err != nil {
			t.Fatalf("%s:%d: %v", spec, n, err)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return Roots{Sys: sysfs.At(sys), Dev: filepath.Join(root, "dev"), UdevRun: filepath.Join(root, "run-udev")}
}

// anyNode stands in for the device node check on fake trees, which have no
// nodes.
func anyNode(*Device) bool { return true }

// writeFile writes a file below dir, creating parents.
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
