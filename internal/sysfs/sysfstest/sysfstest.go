// Package sysfstest builds fake sysfs trees for tests. A Tree is a
// directory of the test's own that the code under test reads through
// Root; the test fills and changes it with the methods below, or loads a
// saved tree. Paths are slash-separated and relative to the tree.
//
// A saved tree is a text file of one entry a line (blank lines and lines
// starting with # are skipped):
//
//	f PATH VALUE   a file holding VALUE and a newline; \n in VALUE is a newline
//	l PATH TARGET  a symbolic link to TARGET
//	b PATH FILE    a copy of FILE, named relative to the saved tree's directory
//	d PATH         an empty directory
package sysfstest

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/sysfs"
)

// Tree is a fake sysfs tree.
type Tree struct {
	t   testing.TB
	dir string
}

// New returns an empty tree in a temporary directory of t.
func New(t testing.TB) *Tree {
	t.Helper()
	return &Tree{t: t, dir: t.TempDir()}
}

// Root is the tree, for the code under test.
func (tr *Tree) Root() sysfs.Root { return sysfs.At(tr.dir) }

// File writes a file holding exactly content, creating its parents.
func (tr *Tree) File(path, content string) {
	tr.t.Helper()
	tr.write(path, []byte(content))
}

// Files writes each file of files (path to content) as File does.
func (tr *Tree) Files(files map[string]string) {
	tr.t.Helper()
	for path, content := range files {
		tr.File(path, content)
	}
}

// Link makes a symbolic link at path to target, creating its parents.
func (tr *Tree) Link(path, target string) {
	tr.t.Helper()
	p := tr.parents(path)
	if err := os.Symlink(target, p); err != nil {
		tr.t.Fatal(err)
	}
}

// Dir makes the directory at path and its parents.
func (tr *Tree) Dir(path string) {
	tr.t.Helper()
	if err := os.MkdirAll(tr.Root().Path(path), 0o755); err != nil {
		tr.t.Fatal(err)
	}
}

// Remove removes path and everything below it, as the kernel removes an
// object's directory.
func (tr *Tree) Remove(path string) {
	tr.t.Helper()
	if err := os.RemoveAll(tr.Root().Path(path)); err != nil {
		tr.t.Fatal(err)
	}
}

// Load adds the entries of the saved tree in file name (see the package
// documentation).
func (tr *Tree) Load(name string) {
	tr.t.Helper()
	f, err := os.Open(name)
	if err != nil {
		tr.t.Fatal(err)
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
		if path == "" {
			tr.t.Fatalf("%s:%d: no path", name, n)
		}
		switch op {
		case "f":
			tr.File(path, strings.ReplaceAll(arg, `\n`, "\n")+"\n")
		case "l":
			tr.Link(path, arg)
		case "b":
			b, err := os.ReadFile(filepath.Join(filepath.Dir(name), arg))
			if err != nil {
				tr.t.Fatalf("%s:%d: %v", name, n, err)
			}
			tr.write(path, b)
		case "d":
			tr.Dir(path)
		default:
			tr.t.Fatalf("%s:%d: unknown entry %q", name, n, op)
		}
	}
	if err := sc.Err(); err != nil {
		tr.t.Fatalf("%s: %v", name, err)
	}
}

func (tr *Tree) write(path string, b []byte) {
	tr.t.Helper()
	if err := os.WriteFile(tr.parents(path), b, 0o644); err != nil {
		tr.t.Fatal(err)
	}
}

// parents creates the parent directories of path and returns its name.
func (tr *Tree) parents(path string) string {
	tr.t.Helper()
	p := tr.Root().Path(path)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		tr.t.Fatal(err)
	}
	return p
}
