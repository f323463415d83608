package archtest

import (
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// osImports reach the kernel directly: system calls, ioctls, raw errnos.
var osImports = []string{"golang.org/x/sys/unix", "syscall"}

// osAccess are the directories (relative to the module root, with their
// subdirectories) whose code may import osImports: the packages that talk
// to the kernel (block devices and their events, filesystems and mounts,
// systemd's sockets, notifications and stop signals), the internal OS
// helpers (the NVMe-oF connect interface among them), and the test
// harnesses. Everything else reaches the OS through them.
var osAccess = []string{"devices", "fs", "systemd", "internal", "test"}

// osExceptions are files outside osAccess that import osImports all the
// same, each with the reason. An entry whose file no longer imports them
// fails the test, so the table only shrinks.
var osExceptions = map[string]string{}

// No package outside osAccess imports x/sys/unix or syscall in its
// non-test files, apart from the files listed in osExceptions.
func TestOSImports(t *testing.T) {
	root := moduleRoot(t)
	violations, stale, err := checkOSImports(root, osAccess, osExceptions)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range violations {
		t.Errorf("%s: only the OS-access packages below %s reach the kernel directly; call them, or move this code into one of them", v, strings.Join(osAccess, ", "))
	}
	for _, f := range stale {
		t.Errorf("%s is listed in osExceptions but imports none of %s: remove it from the table", f, strings.Join(osImports, ", "))
	}
}

// The check finds an import in a file outside osAccess, by any name (a
// renamed import too, in any build of the file), and reports exceptions
// that no longer apply; test files and osAccess directories may import.
func TestCheckOSImportsFindsViolations(t *testing.T) {
	root := t.TempDir()
	write := func(rel, src string) {
		t.Helper()
		p := filepath.Join(root, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("agent/lock_linux.go", "//go:build linux\n\npackage agent\n\nimport \"golang.org/x/sys/unix\"\n\nvar _ = unix.Flock\n")
	write("agent/paths.go", "package agent\n\nimport (\n\t\"errors\"\n\tsc \"syscall\"\n)\n\nvar _ = errors.Is(nil, sc.EBUSY)\n")
	write("agent/agent.go", "package agent\n\nimport \"os\"\n\nvar _ = os.Getpid\n")
	write("agent/agent_test.go", "package agent\n\nimport \"golang.org/x/sys/unix\"\n\nvar _ = unix.Getpid\n")
	write("devices/loop_linux.go", "package devices\n\nimport \"golang.org/x/sys/unix\"\n\nvar _ = unix.Getpid\n")
	write("fsx/x.go", "package fsx\n\nimport \"syscall\"\n\nvar _ = syscall.Getpid\n")
	write("nvmeof/fabrics_linux.go", "package nvmeof\n\nimport \"golang.org/x/sys/unix\"\n\nvar _ = unix.Getpid\n")
	write("nvmeof/sysfs.go", "package nvmeof\n")

	violations, stale, err := checkOSImports(root, []string{"devices", "fs"},
		map[string]string{"nvmeof/fabrics_linux.go": "", "nvmeof/sysfs.go": "", "gone.go": ""})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"agent/lock_linux.go imports golang.org/x/sys/unix",
		"agent/paths.go imports syscall",
		"fsx/x.go imports syscall",
	}
	if !slices.Equal(violations, want) {
		t.Errorf("violations = %q, want %q", violations, want)
	}
	if want := []string{"gone.go", "nvmeof/sysfs.go"}; !slices.Equal(stale, want) {
		t.Errorf("stale exceptions = %q, want %q", stale, want)
	}
}

// checkOSImports walks the Go files below root. It returns the non-test
// files outside allowed that import one of osImports and are not in
// exceptions ("file imports path", sorted), and the exceptions that
// import none (sorted).
func checkOSImports(root string, allowed []string, exceptions map[string]string) (violations, stale []string, err error) {
	used := map[string]bool{}
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "vendor" || underAny(rel, allowed)) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		for _, imp := range f.Imports {
			p, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				return fmt.Errorf("%s: import %s: %w", rel, imp.Path.Value, err)
			}
			if !slices.Contains(osImports, p) {
				continue
			}
			if _, ok := exceptions[rel]; ok {
				used[rel] = true
				continue
			}
			violations = append(violations, rel+" imports "+p)
		}
		return nil
	})
	for f := range exceptions {
		if !used[f] {
			stale = append(stale, f)
		}
	}
	slices.Sort(violations)
	slices.Sort(stale)
	return violations, stale, err
}

// underAny reports whether rel is one of dirs or below one.
func underAny(rel string, dirs []string) bool {
	for _, d := range dirs {
		if rel == d || strings.HasPrefix(rel, d+"/") {
			return true
		}
	}
	return false
}

// moduleRoot is the directory of berth's go.mod, above the test's.
func moduleRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.HasPrefix(string(b), "module github.com/berth-csi/berth\n") {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("berth's go.mod not found above the test's directory")
		}
		dir = parent
	}
}
