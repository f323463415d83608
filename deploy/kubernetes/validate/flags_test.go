package validate

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
)

// berthBinary returns $BERTH_BIN, or builds berth from the repository.
func berthBinary() (string, error) {
	if p := os.Getenv("BERTH_BIN"); p != "" {
		return p, nil
	}
	dir, err := os.MkdirTemp("", "berth-validate-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "berth")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Dir = filepath.Join("..", "..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build berth: %w\n%s", err, out)
	}
	return bin, nil
}

var helpFlag = regexp.MustCompile(`(?m)^\s+--([a-z0-9-]+)`)

// serveFlags lists the flags of berth serve --help, once per test binary.
var serveFlags = sync.OnceValues(func() (map[string]bool, error) {
	bin, err := berthBinary()
	if err != nil {
		return nil, err
	}
	out, err := exec.Command(bin, "serve", "--help").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("berth serve --help: %w\n%s", err, out)
	}
	known := map[string]bool{}
	for _, m := range helpFlag.FindAllStringSubmatch(string(out), -1) {
		known[m[1]] = true
	}
	if !known["endpoint"] {
		return nil, fmt.Errorf("no --endpoint in berth serve --help:\n%s", out)
	}
	return known, nil
})

// checkServeFlags checks the berth container's arguments against the
// binary's own serve --help: a flag berth does not know would crash-loop
// the DaemonSet on every node.
func checkServeFlags(t *testing.T, what string, objs []object) {
	t.Helper()
	args := container(t, daemonSet(t, objs), "berth").Args
	if len(args) == 0 || args[0] != "serve" {
		t.Fatalf("%s: berth container args %v: want serve first", what, args)
	}
	known, err := serveFlags()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range args[1:] {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !known[name] {
			t.Errorf("%s: berth serve does not know %q (see berth serve --help)", what, a)
		}
	}
}

// The DaemonSet's berth arguments, as written, as kustomize renders them,
// and as the chart renders them with its values and with TestChartValues's.
func TestDaemonSetFlags(t *testing.T) {
	checkServeFlags(t, "daemonset.yaml", decode(t, filepath.Join(manifestDir, "daemonset.yaml")))
	checkServeFlags(t, "kustomize build", deployedObjects(t))
	checkServeFlags(t, "helm template", decodeBytes(t, "helm template", helmTemplate(t, nil)))
	checkServeFlags(t, "helm template with values", decodeBytes(t, "helm template", helmTemplate(t, valuesSet)))
}
