package validate

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
)

// berthBinary returns $BERTH_BIN, or builds berth from the repository.
func berthBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("BERTH_BIN"); p != "" {
		return p
	}
	bin := filepath.Join(t.TempDir(), "berth")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Dir = filepath.Join("..", "..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build berth: %v\n%s", err, out)
	}
	return bin
}

var helpFlag = regexp.MustCompile(`(?m)^\s+--([a-z0-9-]+)`)

// TestDaemonSetFlags checks the berth container's arguments against the
// binary's own `serve --help`: a flag berth does not know would crash-loop
// the DaemonSet on every node.
func TestDaemonSetFlags(t *testing.T) {
	objs := decode(t, filepath.Join(manifestDir, "daemonset.yaml"))
	ds := only[appsv1.DaemonSet](t, objs)[0]
	var args []string
	for _, c := range ds.Spec.Template.Spec.Containers {
		if c.Name == "berth" {
			args = c.Args
		}
	}
	if len(args) == 0 || args[0] != "serve" {
		t.Fatalf("berth container args %v: want serve first", args)
	}
	out, err := exec.Command(berthBinary(t), "serve", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("berth serve --help: %v\n%s", err, out)
	}
	known := map[string]bool{}
	for _, m := range helpFlag.FindAllStringSubmatch(string(out), -1) {
		known[m[1]] = true
	}
	if !known["endpoint"] {
		t.Fatalf("no --endpoint in berth serve --help:\n%s", out)
	}
	for _, a := range args[1:] {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !known[name] {
			t.Errorf("berth serve does not know %q (see berth serve --help)", a)
		}
	}
}
