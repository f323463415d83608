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
	"time"
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

var (
	helpFlag    = regexp.MustCompile(`(?m)^\s+--([a-z0-9-]+)`)
	helpDefault = regexp.MustCompile(`(?m)^\s+--([a-z0-9-]+) value .*\(default: ([^)]*)\)`)
)

// serveHelp is berth serve --help, once per test binary.
var serveHelp = sync.OnceValues(func() (string, error) {
	bin, err := berthBinary()
	if err != nil {
		return "", err
	}
	out, err := exec.Command(bin, "serve", "--help").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("berth serve --help: %w\n%s", err, out)
	}
	return string(out), nil
})

// serveFlags lists the flags of berth serve --help.
func serveFlags() (map[string]bool, error) {
	out, err := serveHelp()
	if err != nil {
		return nil, err
	}
	known := map[string]bool{}
	for _, m := range helpFlag.FindAllStringSubmatch(out, -1) {
		known[m[1]] = true
	}
	if !known["endpoint"] {
		return nil, fmt.Errorf("no --endpoint in berth serve --help:\n%s", out)
	}
	return known, nil
}

// serveDefault is the default berth serve --help gives for a flag.
func serveDefault(t *testing.T, name string) string {
	t.Helper()
	out, err := serveHelp()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range helpDefault.FindAllStringSubmatch(out, -1) {
		if m[1] == name {
			return m[2]
		}
	}
	t.Fatalf("berth serve --help gives no default for --%s:\n%s", name, out)
	return ""
}

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

// stopMargin is what a stopping berth needs beyond --shutdown-timeout:
// closing its sockets and the kubelet registration, and exiting.
const stopMargin = 10

// The kubelet kills the pod terminationGracePeriodSeconds after its
// SIGTERM: that must leave berth its --shutdown-timeout to finish the
// calls in flight (an unstage's unmount and detach), as written, as
// kustomize renders it, and as the chart renders it.
func TestGracePeriodCoversShutdownTimeout(t *testing.T) {
	check := func(what string, objs []object) {
		t.Helper()
		ds := daemonSet(t, objs)
		v, ok := argValue(container(t, ds, "berth"), "--shutdown-timeout")
		if !ok {
			v = serveDefault(t, "shutdown-timeout")
		}
		st, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("%s: --shutdown-timeout %q: %v", what, v, err)
		}
		grace := int64(30) // the API's default
		if g := ds.Spec.Template.Spec.TerminationGracePeriodSeconds; g != nil {
			grace = *g
		}
		if want := int64(st.Seconds()) + stopMargin; grace < want {
			t.Errorf("%s: terminationGracePeriodSeconds %d with --shutdown-timeout %s: the kubelet kills berth before it has waited for the calls in flight; want at least %d", what, grace, st, want)
		}
	}
	check("daemonset.yaml", decode(t, filepath.Join(manifestDir, "daemonset.yaml")))
	check("kustomize build", deployedObjects(t))
	check("helm template", decodeBytes(t, "helm template", helmTemplate(t, nil)))
	check("helm template with values", decodeBytes(t, "helm template", helmTemplate(t, valuesSet)))
}
