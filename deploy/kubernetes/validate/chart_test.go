package validate

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// valuesSet sets every value an operator tunes to something other than
// its default.
var valuesSet = map[string]any{
	"image": map[string]any{
		"repository": "registry.example.com/berth",
		"tag":        "v0.2.0",
		"pullPolicy": "Always",
	},
	"imagePullSecrets":  []any{map[string]any{"name": "regcred"}},
	"nodeSelector":      map[string]any{"storage.example.com/berth": "true"},
	"tolerations":       []any{map[string]any{"key": "storage", "operator": "Equal", "value": "only", "effect": "NoSchedule"}},
	"priorityClassName": "berth-critical",
	"resources": map[string]any{
		"requests": map[string]any{"cpu": "50m", "memory": "128Mi"},
		"limits":   map[string]any{"memory": "1Gi"},
	},
	"logLevel":   "debug",
	"transports": []any{"iscsi"},
	"extraArgs":  []any{"--max-volumes=32", "--iscsi-login-timeout=15"},
	"extraEnv": []any{
		map[string]any{"name": "BERTH_TOPOLOGY", "value": "topology.berth.csi.io/rack=r1"},
	},
	"livenessProbe": map[string]any{
		"resources": map[string]any{"requests": map[string]any{"cpu": "5m", "memory": "16Mi"}},
	},
	"attacher": map[string]any{"image": "registry.example.com/csi-attacher:v4.13.0"},
}

// Each value of valuesSet reaches the field it is for, and nothing else
// in the rendered objects changes.
func TestChartValues(t *testing.T) {
	out := helmTemplate(t, valuesSet)
	d := daemonSet(t, decodeBytes(t, "helm template", out))
	spec := d.Spec.Template.Spec
	berth, probe := container(t, d, "berth"), container(t, d, "liveness-probe")

	if berth.Image != "registry.example.com/berth:v0.2.0" || berth.ImagePullPolicy != corev1.PullAlways {
		t.Errorf("image %s, pull policy %s", berth.Image, berth.ImagePullPolicy)
	}
	if want := []corev1.LocalObjectReference{{Name: "regcred"}}; !reflect.DeepEqual(spec.ImagePullSecrets, want) {
		t.Errorf("imagePullSecrets %v, want %v", spec.ImagePullSecrets, want)
	}
	// Helm merges maps: the chart's kubernetes.io/os stays.
	if want := map[string]string{"kubernetes.io/os": "linux", "storage.example.com/berth": "true"}; !reflect.DeepEqual(spec.NodeSelector, want) {
		t.Errorf("nodeSelector %v, want %v", spec.NodeSelector, want)
	}
	if want := []corev1.Toleration{{Key: "storage", Operator: corev1.TolerationOpEqual, Value: "only", Effect: corev1.TaintEffectNoSchedule}}; !reflect.DeepEqual(spec.Tolerations, want) {
		t.Errorf("tolerations %v, want %v", spec.Tolerations, want)
	}
	if spec.PriorityClassName != "berth-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}
	if want := (corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")},
	}); !equalResources(berth.Resources, want) {
		t.Errorf("berth resources %v, want %v", berth.Resources, want)
	}
	if want := (corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("5m"), corev1.ResourceMemory: resource.MustParse("16Mi")},
	}); !equalResources(probe.Resources, want) {
		t.Errorf("liveness-probe resources %v, want %v", probe.Resources, want)
	}
	for _, a := range []string{"--log-level=debug", "--transports=iscsi", "--max-volumes=32", "--iscsi-login-timeout=15"} {
		if !slices.Contains(berth.Args, a) {
			t.Errorf("berth args %v lack %s", berth.Args, a)
		}
	}
	if n := len(berth.Env); n < 2 || berth.Env[n-1].Name != "BERTH_TOPOLOGY" || berth.Env[n-1].Value != "topology.berth.csi.io/rack=r1" {
		t.Errorf("berth env %v: want BERTH_TOPOLOGY last", berth.Env)
	}
	ctlSpec := deployment(t, decodeBytes(t, "helm template", out), "berth-controller").Spec.Template.Spec
	if img := podContainer(t, ctlSpec, "csi-attacher").Image; img != "registry.example.com/csi-attacher:v4.13.0" {
		t.Errorf("attacher image %s, want attacher.image's", img)
	}
	if img := podContainer(t, ctlSpec, "berth").Image; img != berth.Image {
		t.Errorf("controller's berth image %s, want the DaemonSet's %s", img, berth.Image)
	}
	if berth.Env[0].Name != "NODE_NAME" {
		t.Errorf("berth env %v: extraEnv must not displace NODE_NAME", berth.Env)
	}

	// Nothing else changed: every difference from the default rendering is
	// under a field one of the values is for.
	ds := "apps/v1 DaemonSet kube-system/berth-node.spec.template.spec."
	ctl := "apps/v1 Deployment kube-system/berth-controller.spec.template.spec."
	allowed := []string{
		ds + "imagePullSecrets", ds + "nodeSelector", ds + "tolerations", ds + "priorityClassName",
		ds + "containers[0].image", ds + "containers[0].args", ds + "containers[0].env",
		ds + "containers[0].resources", ds + "containers[1].resources",
		// The controller runs berth's image, with the same pull secrets.
		ctl + "imagePullSecrets", ctl + "containers[0].image", ctl + "containers[0].imagePullPolicy",
		ctl + "containers[1].image",
	}
	for _, d := range Diff(splitObjects(t, helmTemplate(t, nil)), splitObjects(t, out)) {
		if !slices.ContainsFunc(allowed, func(p string) bool { return strings.HasPrefix(d, p) }) {
			t.Errorf("a value changed a field it is not for: %s", d)
		}
	}
}

// transports: null (the default) leaves berth's default; a list, even an
// empty one, is passed as --transports.
func TestChartTransports(t *testing.T) {
	for _, c := range []struct {
		transports any
		want       string
		set        bool
	}{
		{nil, "", false},
		{[]any{"nvmeof"}, "nvmeof", true},
		{[]any{"nvmeof", "iscsi"}, "nvmeof,iscsi", true},
		{[]any{}, "", true},
	} {
		values := map[string]any{"transports": c.transports}
		if c.transports == nil {
			values = nil
		}
		berth := container(t, daemonSet(t, decodeBytes(t, "helm template", helmTemplate(t, values))), "berth")
		got, set := argValue(berth, "--transports")
		if set != c.set || got != c.want {
			t.Errorf("transports %v: --transports %q (set %v), want %q (set %v)", c.transports, got, set, c.want, c.set)
		}
	}
}

func equalResources(a, b corev1.ResourceRequirements) bool {
	eq := func(x, y corev1.ResourceList) bool {
		if len(x) != len(y) {
			return false
		}
		for k, v := range x {
			if w, ok := y[k]; !ok || v.Cmp(w) != 0 {
				return false
			}
		}
		return true
	}
	return eq(a.Requests, b.Requests) && eq(a.Limits, b.Limits)
}

// values.schema.json refuses what berth would refuse at start, or what the
// chart would silently ignore: helm template fails on each.
func TestChartSchema(t *testing.T) {
	helm := tool(t, "helm", "BERTH_HELM")
	for what, values := range map[string]map[string]any{
		"misspelt value":      {"nodeselector": map[string]any{"disk": "ssd"}},
		"misspelt image.tag":  {"image": map[string]any{"tags": "v0.2.0"}},
		"unknown log level":   {"logLevel": "verbose"},
		"unknown transport":   {"transports": []any{"rdma"}},
		"transports a string": {"transports": "iscsi"},
		"an argument no flag": {"extraArgs": []any{"max-volumes=32"}},
		"env without a name":  {"extraEnv": []any{map[string]any{"value": "x"}}},
		"relative kubeletDir": {"kubeletDir": "var/lib/kubelet"},
		"port out of range":   {"livenessProbe": map[string]any{"port": 70000}},
	} {
		out, err := run(t, helm, helmArgs(t, "template", values, release, chartDir, "--namespace", namespace)...)
		if err == nil {
			t.Errorf("%s %v: helm template rendered it:\n%s", what, values, out)
		} else if !strings.Contains(err.Error(), "schema") {
			t.Errorf("%s %v: refused, but not by the schema: %v", what, values, err)
		}
	}
}
