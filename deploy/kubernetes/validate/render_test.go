package validate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

const (
	chartDir  = "../../helm/berth"
	release   = "berth"
	namespace = "kube-system"
)

// tool returns the helm or kustomize to run: $BERTH_HELM or
// $BERTH_KUSTOMIZE (make manifest-test installs the pinned versions and
// sets them), else the one on PATH. Without it the test skips, and under
// BERTH_CI=1 fails: unrendered manifests are unchecked ones.
func tool(t *testing.T, name, env string) string {
	t.Helper()
	if p := os.Getenv(env); p != "" {
		return p
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	if os.Getenv("BERTH_CI") == "1" {
		t.Fatalf("BERTH_CI=1: no %s: set %s (make manifest-test installs it)", name, env)
	}
	t.Skipf("no %s: set %s or run make manifest-test", name, env)
	return ""
}

// run runs a tool with an argument vector and returns its standard output;
// its standard error goes into the error.
func run(t *testing.T, bin string, args ...string) ([]byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", filepath.Base(bin), strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// kustomize renders dir with kustomize build, as kubectl apply -k deploys it.
func kustomize(t *testing.T, dir string) []byte {
	t.Helper()
	out, err := run(t, tool(t, "kustomize", "BERTH_KUSTOMIZE"), "build", dir)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// helmTemplate renders the chart with helm template, release berth in
// kube-system, with values (nil: the chart's own) given as a values file.
func helmTemplate(t *testing.T, values map[string]any) []byte {
	t.Helper()
	out, err := run(t, tool(t, "helm", "BERTH_HELM"), helmArgs(t, "template", values, release, chartDir, "--namespace", namespace)...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// helmArgs is helm's command line: the command, -f with values written to a
// file when there are any, then args.
func helmArgs(t *testing.T, command string, values map[string]any, args ...string) []string {
	t.Helper()
	argv := []string{command}
	if values != nil {
		data, err := yaml.Marshal(values)
		if err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(t.TempDir(), "values.yaml")
		if err := os.WriteFile(f, data, 0o644); err != nil {
			t.Fatal(err)
		}
		argv = append(argv, "--values", f)
	}
	return append(argv, args...)
}

// Object is one rendered Kubernetes object, as decoded from YAML.
type Object = map[string]any

// splitObjects decodes every non-empty document of a YAML stream.
func splitObjects(t *testing.T, data []byte) []Object {
	t.Helper()
	var out []Object
	for i, doc := range docSep.Split(string(data), -1) {
		var o Object
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatalf("document %d: %v", i+1, err)
		}
		if len(o) > 0 {
			out = append(out, o)
		}
	}
	if len(out) == 0 {
		t.Fatal(errors.New("nothing rendered"))
	}
	return out
}

func field(o Object, path ...string) any {
	var cur any = o
	for _, p := range path {
		m, _ := cur.(map[string]any)
		cur = m[p]
	}
	return cur
}

// ObjectKey names an object: apiVersion, kind, namespace and name.
func ObjectKey(o Object) string {
	return fmt.Sprintf("%v %v %v/%v", o["apiVersion"], o["kind"], field(o, "metadata", "namespace"), field(o, "metadata", "name"))
}

// Diff lists where two object sets differ: objects only in one, and each
// field path whose values differ.
func Diff(a, b []Object) []string {
	index := func(objs []Object) map[string]Object {
		m := map[string]Object{}
		for _, o := range objs {
			m[ObjectKey(o)] = o
		}
		return m
	}
	am, bm := index(a), index(b)
	var out []string
	for _, k := range slices.Sorted(maps.Keys(am)) {
		bo, ok := bm[k]
		if !ok {
			out = append(out, k+": only in the first")
			continue
		}
		out = append(out, diffValue(k, am[k], bo)...)
	}
	for _, k := range slices.Sorted(maps.Keys(bm)) {
		if _, ok := am[k]; !ok {
			out = append(out, k+": only in the second")
		}
	}
	return out
}

func diffValue(path string, a, b any) []string {
	switch av := a.(type) {
	case map[string]any:
		bv, ok := b.(map[string]any)
		if !ok {
			break
		}
		var out []string
		keys := slices.Sorted(maps.Keys(av))
		for _, k := range slices.Sorted(maps.Keys(bv)) {
			if _, ok := av[k]; !ok {
				keys = append(keys, k)
			}
		}
		for _, k := range keys {
			out = append(out, diffValue(path+"."+k, av[k], bv[k])...)
		}
		return out
	case []any:
		bv, ok := b.([]any)
		if !ok || len(bv) != len(av) {
			break
		}
		var out []string
		for i := range av {
			out = append(out, diffValue(fmt.Sprintf("%s[%d]", path, i), av[i], bv[i])...)
		}
		return out
	}
	if fmt.Sprintf("%#v", a) == fmt.Sprintf("%#v", b) {
		return nil
	}
	return []string{fmt.Sprintf("%s: %s vs %s", path, short(a), short(b))}
}

func short(v any) string {
	b, _ := yaml.Marshal(v)
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	return s
}
