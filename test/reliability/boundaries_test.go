package reliability

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// hostPackages are the packages whose boundaries the host suite reaches.
var hostPackages = []string{"agent", "fs", "devices"}

// vmPackages are the transport packages whose boundaries their VM crash
// suite reaches (each runs in a guest of its own: TestVMCrash*).
var vmPackages = []string{"nvmeof", "iscsi"}

// sourceBoundaries lists the step boundaries written in the packages
// (directories of the module): failpoint.Hit("name") calls and the step
// timer's mark("name") calls (which hit "step.name").
func sourceBoundaries(t *testing.T, pkgs ...string) []string {
	t.Helper()
	seen := map[string]bool{}
	for _, pkg := range pkgs {
		if err := walkBoundaries(filepath.Join("..", "..", pkg), true, seen); err != nil {
			t.Fatal(err)
		}
	}
	out := sortedKeys(seen)
	if len(out) == 0 {
		t.Fatal("found no step boundary in the source")
	}
	return out
}

// boundariesIn lists the step boundaries of the one package in dir
// (relative to the module root), without its subdirectories.
func boundariesIn(t *testing.T, dir string) []string {
	t.Helper()
	seen := map[string]bool{}
	if err := walkBoundaries(filepath.Join("..", "..", dir), false, seen); err != nil {
		t.Fatal(err)
	}
	return sortedKeys(seen)
}

// walkBoundaries adds to seen the boundaries in the non-test Go files of
// dir, and of its subdirectories when recursive.
func walkBoundaries(dir string, recursive bool, seen map[string]bool) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != dir && !recursive {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) != 1 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			name, _ := strconv.Unquote(lit.Value)
			switch {
			case sel.Sel.Name == "Hit" && isIdent(sel.X, "failpoint"):
				seen[name] = true
			case sel.Sel.Name == "mark":
				seen["step."+name] = true
			}
			return true
		})
		return nil
	})
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

// TestEveryBoundaryHasASuite fails when a package outside hostPackages
// and vmPackages has a step boundary: no crash suite would check it.
func TestEveryBoundaryHasASuite(t *testing.T) {
	covered := map[string]bool{}
	for _, p := range append(append([]string(nil), hostPackages...), vmPackages...) {
		covered[p] = true
	}
	root := filepath.Join("..", "..")
	var dirs []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		// internal/failpoint itself, tests and nested modules mark none.
		switch {
		case rel == ".":
			return nil
		case covered[rel]:
			return filepath.SkipDir // its tree is the suite's
		case strings.HasPrefix(d.Name(), "."), rel == "test", rel == "internal", rel == "deploy":
			return filepath.SkipDir
		}
		dirs = append(dirs, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range dirs {
		if names := boundariesIn(t, dir); len(names) > 0 {
			t.Errorf("package %s has step boundaries %q, but no crash suite covers it: add it to hostPackages or vmPackages", dir, names)
		}
	}
	for _, pkg := range vmPackages {
		if len(boundariesIn(t, pkg)) == 0 {
			t.Errorf("package %s is in vmPackages but has no step boundary", pkg)
		}
	}
}
