package validate

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
)

// Ports other CSI drivers' sidecars take by default on the node's network
// (livenessprobe 9808, node-driver-registrar 9809): two drivers on one
// node with hostNetwork would fight over them.
var commonPorts = map[int]string{9808: "livenessprobe's default", 9809: "node-driver-registrar's default"}

// expand resolves $(VAR) in a container argument from its env values,
// as the kubelet does.
func expand(c corev1.Container, s string) string {
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			s = strings.ReplaceAll(s, "$("+e.Name+")", e.Value)
		}
	}
	return s
}

func argValue(c corev1.Container, name string) (string, bool) {
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return expand(c, v), true
		}
		if a == name {
			return "", true
		}
	}
	return "", false
}

func container(t *testing.T, ds *appsv1.DaemonSet, name string) corev1.Container {
	t.Helper()
	for _, c := range ds.Spec.Template.Spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s", name)
	return corev1.Container{}
}

func daemonSet(t *testing.T, objs []object) *appsv1.DaemonSet {
	t.Helper()
	dss := only[appsv1.DaemonSet](t, objs)
	if len(dss) != 1 {
		t.Fatalf("%d DaemonSets, want 1", len(dss))
	}
	return dss[0]
}

// TestNodePractice checks the DaemonSet and the CSIDriver against what
// node plugins in other clusters are expected to do.
func TestNodePractice(t *testing.T) {
	objs := deployedObjects(t)
	ds := daemonSet(t, objs)
	spec := ds.Spec.Template.Spec

	if spec.NodeSelector["kubernetes.io/os"] != "linux" {
		t.Errorf("nodeSelector %v: want kubernetes.io/os: linux (berth is Linux only; Windows nodes must not get the pod)", spec.NodeSelector)
	}

	// Ports: none of the common defaults; metrics not on every interface.
	for _, c := range spec.Containers {
		var ports []string
		for _, p := range c.Ports {
			ports = append(ports, strconv.Itoa(int(p.ContainerPort)))
		}
		for _, pr := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe, c.StartupProbe} {
			if pr != nil && pr.HTTPGet != nil {
				ports = append(ports, pr.HTTPGet.Port.String())
			}
		}
		for _, f := range []string{"--http-endpoint", "--metrics-address", "--health-port"} {
			if v, ok := argValue(c, f); ok {
				host, port, err := net.SplitHostPort(v)
				if err != nil {
					t.Errorf("container %s %s=%s: %v", c.Name, f, v, err)
					continue
				}
				ports = append(ports, port)
				if host == "" || host == "0.0.0.0" || host == "::" {
					t.Errorf("container %s %s=%s listens on every interface of the node (hostNetwork): bind 127.0.0.1 or the pod IP", c.Name, f, v)
				}
			}
		}
		for _, p := range ports {
			n, _ := strconv.Atoi(p)
			if why, ok := commonPorts[n]; ok {
				t.Errorf("container %s uses port %d, %s: another driver's sidecar on the node takes it", c.Name, n, why)
			}
		}
	}

	// Built-in registration: berth registers itself under the kubelet
	// directory it mounts; no registrar sidecar competes for the socket.
	berth := container(t, ds, "berth")
	if _, ok := argValue(berth, "--kubelet-registration"); !ok {
		t.Error("berth does not run with --kubelet-registration")
	}
	for _, c := range spec.Containers {
		if c.Name == "node-driver-registrar" {
			t.Error("a node-driver-registrar container beside berth's own registration: two registrars for one driver")
		}
	}

	// SELinux: a sidecar that dials berth's socket must be allowed to
	// connect to a socket a privileged (spc_t) process created.
	for _, c := range spec.Containers {
		privileged := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
		if privileged || !dialsSocket(c) {
			continue
		}
		sc := c.SecurityContext
		if sc == nil || sc.SELinuxOptions == nil || sc.SELinuxOptions.Type != "spc_t" {
			if ps := spec.SecurityContext; ps == nil || ps.SELinuxOptions == nil || ps.SELinuxOptions.Type != "spc_t" {
				t.Errorf("container %s dials berth's socket but is confined (container_t) on SELinux nodes: set seLinuxOptions.type spc_t", c.Name)
			}
		}
	}

	drivers := only[storagev1.CSIDriver](t, objs)
	if len(drivers) != 1 || drivers[0].Spec.SELinuxMount == nil || !*drivers[0].Spec.SELinuxMount {
		t.Error("CSIDriver seLinuxMount must be true: berth passes context= mount options to the staging mount (fs.ParseMountOptions)")
	}
}

func dialsSocket(c corev1.Container) bool {
	_, ok := argValue(c, "--csi-address")
	return ok
}

var releaseTag = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+$`)

// imageRepository is the berth image's name in the manifests, the chart
// and make image: fully qualified, so that no node resolves it against
// another default registry (berth:v0.1.0 is docker.io/library/berth).
const imageRepository = "ghcr.io/berth-csi/berth"

// The berth container runs the image make image builds: the project's
// name, tagged with the release in the file VERSION (which make image and
// berth version read), in the kustomize base and in the chart alike.
func TestImage(t *testing.T) {
	v, err := os.ReadFile(filepath.Join(manifestDir, "..", "..", "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	version := strings.TrimSpace(string(v))
	if !releaseTag.MatchString(version) {
		t.Fatalf("VERSION %q: want vX.Y.Z", version)
	}
	want := imageRepository + ":" + version
	for what, out := range map[string][]byte{
		"kustomize base": kustomize(t, manifestDir),
		"Helm chart":     helmTemplate(t, nil),
	} {
		if img := container(t, daemonSet(t, decodeBytes(t, what, out)), "berth").Image; img != want {
			t.Errorf("%s: berth image %q: want %s, the image make image builds from VERSION", what, img, want)
		}
	}
	mk, err := os.ReadFile(filepath.Join(manifestDir, "..", "..", "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{"\nIMAGE_NAME ?= " + imageRepository + "\n", "\nIMAGE_TAG  ?= $(VERSION)\n", "\nVERSION   ?= $(shell cat VERSION)\n"} {
		if !bytes.Contains(mk, []byte(line)) {
			t.Errorf("the Makefile lacks %q", strings.TrimSpace(line))
		}
	}
}

// Another build or a registry copy is deployed by changing the image in
// one place: an overlay's images entry (kustomize) or image.repository and
// image.tag (Helm).
func TestImageOverride(t *testing.T) {
	const want = "registry.example.com/storage/berth:v9.8.7-rc1"
	base, err := filepath.Abs(manifestDir)
	if err != nil {
		t.Fatal(err)
	}
	overlay := t.TempDir()
	rel, err := filepath.Rel(overlay, base)
	if err != nil {
		t.Fatal(err)
	}
	k := "resources:\n  - " + rel + "\nimages:\n  - name: " + imageRepository +
		"\n    newName: registry.example.com/storage/berth\n    newTag: v9.8.7-rc1\n"
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	for what, out := range map[string][]byte{
		"kustomize overlay": kustomize(t, overlay),
		"Helm chart": helmTemplate(t, map[string]any{"image": map[string]any{
			"repository": "registry.example.com/storage/berth", "tag": "v9.8.7-rc1"}}),
	} {
		if img := container(t, daemonSet(t, decodeBytes(t, what, out)), "berth").Image; img != want {
			t.Errorf("%s: berth image %q, want %s", what, img, want)
		}
	}
}

// The systemd units register berth with the kubelet without a sidecar.
func TestSystemdRegisters(t *testing.T) {
	root := filepath.Join(manifestDir, "..", "..", "systemd")
	service, err := os.ReadFile(filepath.Join(root, "berth.service"))
	if err != nil {
		t.Fatal(err)
	}
	var exec string
	for _, l := range strings.Split(string(service), "\n") {
		if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
			exec = v
		}
	}
	if !strings.Contains(" "+exec+" ", " --kubelet-registration ") {
		t.Errorf("berth.service ExecStart=%s: without --kubelet-registration nothing registers berth with the kubelet on a systemd install", exec)
	}
	socket, err := os.ReadFile(filepath.Join(root, "berth.socket"))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(socket, []byte("berth's own registration")) || !bytes.Contains(socket, []byte("--kubelet-registration")) {
		t.Error("berth.socket's comment must name the registration berth.service does (--kubelet-registration)")
	}
}

// deployedObjects are the objects kubectl apply -k deploys, decoded
// strictly into their API types.
func deployedObjects(t *testing.T) []object {
	t.Helper()
	return decodeBytes(t, "kustomize build", kustomize(t, manifestDir))
}

// helm lint --strict passes with the chart's values and with every value
// TestChartValues sets.
func TestHelmLint(t *testing.T) {
	helm := tool(t, "helm", "BERTH_HELM")
	for what, values := range map[string]map[string]any{"default values": nil, "values set": valuesSet} {
		if out, err := run(t, helm, helmArgs(t, "lint", values, "--strict", "--namespace", namespace, chartDir)...); err != nil {
			t.Errorf("%s: %v\n%s", what, err, out)
		}
	}
}

// The Helm chart deploys the same objects as the kustomize base, field
// for field, with its default values (in kube-system, like the base).
func TestHelmChartMatchesKustomize(t *testing.T) {
	kout, hout := kustomize(t, manifestDir), helmTemplate(t, nil)
	decodeBytes(t, "helm template", hout)
	k, h := splitObjects(t, kout), splitObjects(t, hout)
	if d := Diff(k, h); len(d) > 0 {
		t.Errorf("the chart and the kustomize base differ (kustomize vs helm):\n%s", strings.Join(d, "\n"))
	}
	if len(k) != 11 {
		t.Errorf("%d objects, want 11: the CSIDriver; the node's ServiceAccount, ClusterRole, ClusterRoleBinding and DaemonSet; the controller's Deployment, ServiceAccount, ClusterRole, ClusterRoleBinding, Role and RoleBinding", len(k))
	}
}

// The kubelet directory is set in one place: with another directory in
// kubelet-dir.yaml (kustomize) or kubeletDir (Helm), no object names the
// default any more, and berth's endpoint, registration directory and
// mounts follow.
func TestKubeletDirOnePlace(t *testing.T) {
	const moved = "/var/lib/k0s/kubelet"
	dir := t.TempDir()
	files, _ := filepath.Glob(filepath.Join(manifestDir, "*.yaml"))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(f) == "kubelet-dir.yaml" {
			if !bytes.Contains(data, []byte("kubeletDir: "+kubeletDir+"\n")) {
				t.Fatalf("kubelet-dir.yaml does not set kubeletDir: %s", kubeletDir)
			}
			data = bytes.ReplaceAll(data, []byte("kubeletDir: "+kubeletDir+"\n"), []byte("kubeletDir: "+moved+"\n"))
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rendered := map[string][]byte{
		"kustomize": kustomize(t, dir),
		"helm":      helmTemplate(t, map[string]any{"kubeletDir": moved}),
	}
	for what, out := range rendered {
		ds := daemonSet(t, decodeBytes(t, what, out))
		if bytes.Contains(out, []byte(kubeletDir)) {
			t.Errorf("%s: with the kubelet directory moved to %s, %s is still named:\n%s", what, moved, kubeletDir, out)
			continue
		}
		berth := container(t, ds, "berth")
		if ep, _ := argValue(berth, "--endpoint"); ep != "unix://"+moved+"/plugins/"+driver+"/csi.sock" {
			t.Errorf("%s: berth --endpoint %s", what, ep)
		}
		hostPaths := map[string]string{}
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.HostPath != nil {
				hostPaths[v.Name] = v.HostPath.Path
			}
		}
		if hostPaths["kubelet-dir"] != moved || hostPaths["plugin-dir"] != moved+"/plugins/"+driver {
			t.Errorf("%s: host paths %v", what, hostPaths)
		}
	}
	if d := Diff(splitObjects(t, rendered["kustomize"]), splitObjects(t, rendered["helm"])); len(d) > 0 {
		t.Errorf("with the kubelet directory moved, the chart and the kustomize base differ:\n%s", strings.Join(d, "\n"))
	}
}
