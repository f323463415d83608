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

// hostPackages are the packages whose boundaries the host suite reaches;
// the transports' own are crashed in the VM suites.
var hostPackages = []string{"agent", "fs", "devices"}

// sourceBoundaries lists the step boundaries written in the host
// packages: failpoint.Hit("name") calls and the step timer's
// mark("name") calls (which hit "step.name").
func sourceBoundaries(t *testing.T) []string {
	t.Helper()
	seen := map[string]bool{}
	for _, pkg := range hostPackages {
		dir := filepath.Join("..", "..", pkg)
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
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
		if err != nil {
			t.Fatal(err)
		}
	}
	var out []string
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	if len(out) == 0 {
		t.Fatal("found no step boundary in the source")
	}
	return out
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}
