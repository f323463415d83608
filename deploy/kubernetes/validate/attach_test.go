package validate

import (
	"fmt"
	"os/exec"
	"path"
	"slices"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// attacherImage is the external-attacher the manifests deploy: the
// version test/e2e builds and runs (test/e2e/attacher).
const attacherImage = "registry.k8s.io/sig-storage/csi-attacher:v4.13.0"

func deployment(t *testing.T, objs []object, name string) *appsv1.Deployment {
	t.Helper()
	for _, d := range only[appsv1.Deployment](t, objs) {
		if d.Name == name {
			return d
		}
	}
	t.Fatalf("no Deployment %s", name)
	return nil
}

func podContainer(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s", name)
	return corev1.Container{}
}

// allows reports whether the rules bound to service account ns/sa (by the
// ClusterRoleBindings, and the RoleBindings of namespace where) allow verb
// on group/resource in namespace where ("" for a cluster-scoped one).
func allows(objs []object, ns, sa, where, group, resource, verb string) bool {
	subject := func(subjects []rbacv1.Subject) bool {
		return slices.ContainsFunc(subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == ns
		})
	}
	match := func(rules []rbacv1.PolicyRule) bool {
		return slices.ContainsFunc(rules, func(r rbacv1.PolicyRule) bool {
			return slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) &&
				(slices.Contains(r.Verbs, verb) || slices.Contains(r.Verbs, "*"))
		})
	}
	clusterRoles := map[string][]rbacv1.PolicyRule{}
	for _, r := range only[rbacv1.ClusterRole](nil, objs) {
		clusterRoles[r.Name] = r.Rules
	}
	roles := map[string][]rbacv1.PolicyRule{}
	for _, r := range only[rbacv1.Role](nil, objs) {
		roles[r.Namespace+"/"+r.Name] = r.Rules
	}
	for _, b := range only[rbacv1.ClusterRoleBinding](nil, objs) {
		if subject(b.Subjects) && b.RoleRef.Kind == "ClusterRole" && match(clusterRoles[b.RoleRef.Name]) {
			return true
		}
	}
	if where == "" {
		return false
	}
	for _, b := range only[rbacv1.RoleBinding](nil, objs) {
		if b.Namespace != where || !subject(b.Subjects) {
			continue
		}
		rules := clusterRoles[b.RoleRef.Name]
		if b.RoleRef.Kind == "Role" {
			rules = roles[b.Namespace+"/"+b.RoleRef.Name]
		}
		if match(rules) {
			return true
		}
	}
	return false
}

// checkAttach checks what attachRequired: true depends on, in one
// rendering: the controller Deployment (berth controller and the
// attacher on one socket, leader election on, the attacher's RBAC) and the
// node's takeover (the flag, the token in berth's container only, the
// reads it makes).
func checkAttach(t *testing.T, what string, objs []object, wantAttacher string) {
	t.Helper()
	d := deployment(t, objs, "berth-controller")
	spec := d.Spec.Template.Spec
	for k, v := range d.Spec.Selector.MatchLabels {
		if d.Spec.Template.Labels[k] != v {
			t.Errorf("%s: controller selector %s=%s does not match the pod template", what, k, v)
		}
	}
	ds := daemonSet(t, objs)
	matches := true
	for k, v := range ds.Spec.Selector.MatchLabels {
		matches = matches && d.Spec.Template.Labels[k] == v
	}
	if matches {
		t.Errorf("%s: the DaemonSet's selector matches the controller's pods", what)
	}
	berth := podContainer(t, spec, "berth")
	attacher := podContainer(t, spec, "csi-attacher")
	if len(berth.Args) == 0 || berth.Args[0] != "controller" {
		t.Errorf("%s: controller's berth args %v: want the controller command first", what, berth.Args)
	}
	if berth.Image != container(t, ds, "berth").Image {
		t.Errorf("%s: controller image %s, DaemonSet image %s: one berth, one image", what, berth.Image, container(t, ds, "berth").Image)
	}
	if berth.SecurityContext == nil || berth.SecurityContext.Privileged != nil && *berth.SecurityContext.Privileged ||
		berth.SecurityContext.AllowPrivilegeEscalation == nil || *berth.SecurityContext.AllowPrivilegeEscalation {
		t.Errorf("%s: berth controller needs no privilege: want allowPrivilegeEscalation false, not privileged", what)
	}
	if attacher.Image != wantAttacher {
		t.Errorf("%s: attacher image %s, want %s", what, attacher.Image, wantAttacher)
	}
	if dn, _ := argValue(berth, "--driver-name"); dn != driver {
		t.Errorf("%s: berth controller --driver-name %q, want %q: the attacher handles the VolumeAttachments of the driver GetPluginInfo names", what, dn, driver)
	}
	ep, _ := argValue(berth, "--endpoint")
	addr, _ := argValue(attacher, "--csi-address")
	mountOf := func(c corev1.Container, p string) string {
		for _, m := range c.VolumeMounts {
			if m.MountPath == path.Dir(p) {
				return m.Name
			}
		}
		return ""
	}
	if sock := strings.TrimPrefix(ep, "unix://"); sock != addr || mountOf(berth, sock) == "" || mountOf(berth, sock) != mountOf(attacher, addr) {
		t.Errorf("%s: berth controller listens on %s, the attacher dials %s: want one socket in a volume both mount", what, ep, addr)
	}
	if le, ok := argValue(attacher, "--leader-election"); !ok || (le != "" && le != "true") {
		t.Errorf("%s: the attacher runs without --leader-election: two attachers would race over one VolumeAttachment", what)
	}
	sa := spec.ServiceAccountName
	for _, p := range []struct{ group, resource, verb string }{
		{"", "persistentvolumes", "get"}, {"", "persistentvolumes", "list"}, {"", "persistentvolumes", "watch"}, {"", "persistentvolumes", "patch"},
		{"", "nodes", "get"}, {"", "nodes", "list"}, {"", "nodes", "watch"},
		{"storage.k8s.io", "csinodes", "get"}, {"storage.k8s.io", "csinodes", "list"}, {"storage.k8s.io", "csinodes", "watch"},
		{"storage.k8s.io", "volumeattachments", "get"}, {"storage.k8s.io", "volumeattachments", "list"},
		{"storage.k8s.io", "volumeattachments", "watch"}, {"storage.k8s.io", "volumeattachments", "patch"},
		{"storage.k8s.io", "volumeattachments/status", "patch"},
		{"", "events", "create"}, {"", "events", "patch"},
	} {
		if !allows(objs, d.Namespace, sa, "", p.group, p.resource, p.verb) {
			t.Errorf("%s: the attacher's account %s may not %s %s", what, sa, p.verb, p.resource)
		}
	}
	for _, verb := range []string{"get", "list", "watch", "create", "update", "delete"} {
		if !allows(objs, d.Namespace, sa, d.Namespace, "coordination.k8s.io", "leases", verb) {
			t.Errorf("%s: the attacher's account %s may not %s leases in %s (leader election)", what, sa, verb, d.Namespace)
		}
	}

	// The node: --takeover-from-kubernetes with the reads it makes, and
	// nothing it could change.
	node := container(t, ds, "berth")
	if _, ok := argValue(node, "--takeover-from-kubernetes"); !ok {
		t.Errorf("%s: the DaemonSet's berth runs without --takeover-from-kubernetes", what)
	}
	nsa := ds.Spec.Template.Spec.ServiceAccountName
	for _, p := range []struct{ group, resource, verb string }{
		{"storage.k8s.io", "volumeattachments", "get"}, {"storage.k8s.io", "volumeattachments", "list"},
		{"", "nodes", "get"}, {"", "nodes", "list"},
	} {
		if !allows(objs, ds.Namespace, nsa, "", p.group, p.resource, p.verb) {
			t.Errorf("%s: the node's account %s may not %s %s (--takeover-from-kubernetes)", what, nsa, p.verb, p.resource)
		}
	}
	for _, p := range []struct{ group, resource, verb string }{
		{"storage.k8s.io", "volumeattachments", "patch"}, {"", "nodes", "patch"}, {"", "nodes", "update"},
		{"", "pods", "delete"}, {"", "secrets", "get"}, {"storage.k8s.io", "volumeattachments", "delete"},
	} {
		if allows(objs, ds.Namespace, nsa, ds.Namespace, p.group, p.resource, p.verb) {
			t.Errorf("%s: the node's account %s may %s %s: it only reads", what, nsa, p.verb, p.resource)
		}
	}
	const tokenDir = "/var/run/secrets/kubernetes.io/serviceaccount"
	if ds.Spec.Template.Spec.AutomountServiceAccountToken == nil || *ds.Spec.Template.Spec.AutomountServiceAccountToken {
		t.Errorf("%s: the DaemonSet mounts the token into every container: want automountServiceAccountToken false and the token projected into berth's", what)
	}
	for _, c := range ds.Spec.Template.Spec.Containers {
		has := slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == tokenDir })
		if has != (c.Name == "berth") {
			t.Errorf("%s: container %s: the token at %s: %v, want it in berth's only", what, c.Name, tokenDir, has)
		}
	}
	var projected *corev1.ProjectedVolumeSource
	for _, v := range ds.Spec.Template.Spec.Volumes {
		for _, m := range node.VolumeMounts {
			if m.MountPath == tokenDir && m.Name == v.Name {
				projected = v.Projected
			}
		}
	}
	var token, ca bool
	if projected != nil {
		for _, s := range projected.Sources {
			token = token || s.ServiceAccountToken != nil && s.ServiceAccountToken.Path == "token"
			ca = ca || s.ConfigMap != nil && s.ConfigMap.Name == "kube-root-ca.crt" &&
				slices.ContainsFunc(s.ConfigMap.Items, func(k corev1.KeyToPath) bool { return k.Key == "ca.crt" && k.Path == "ca.crt" })
		}
	}
	if !token || !ca {
		t.Errorf("%s: berth's %s must be a projected volume with the token (token) and kube-root-ca.crt's ca.crt", what, tokenDir)
	}
}

func TestAttach(t *testing.T) {
	// The version test/e2e builds and runs.
	checkAttach(t, "kustomize build", deployedObjects(t), attacherImage)
	checkAttach(t, "helm template", decodeBytes(t, "helm template", helmTemplate(t, nil)), attacherImage)
	checkAttach(t, "helm template with values", decodeBytes(t, "helm template", helmTemplate(t, valuesSet)), "registry.example.com/csi-attacher:v4.13.0")
}

// controllerFlags lists the flags of berth controller --help.
var controllerFlags = sync.OnceValues(func() (map[string]bool, error) {
	bin, err := berthBinary()
	if err != nil {
		return nil, err
	}
	out, err := exec.Command(bin, "controller", "--help").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("berth controller --help: %w\n%s", err, out)
	}
	known := map[string]bool{}
	for _, m := range helpFlag.FindAllStringSubmatch(string(out), -1) {
		known[m[1]] = true
	}
	if !known["endpoint"] {
		return nil, fmt.Errorf("no --endpoint in berth controller --help:\n%s", out)
	}
	return known, nil
})

// The controller's berth arguments are flags berth controller knows: one
// it does not would crash-loop the controller, and no volume would attach.
func TestControllerFlags(t *testing.T) {
	known, err := controllerFlags()
	if err != nil {
		t.Fatal(err)
	}
	for what, out := range map[string][]byte{"kustomize build": kustomize(t, manifestDir), "helm template": helmTemplate(t, nil)} {
		args := podContainer(t, deployment(t, decodeBytes(t, what, out), "berth-controller").Spec.Template.Spec, "berth").Args
		for _, a := range args[1:] {
			name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			if !strings.HasPrefix(a, "--") || !known[name] {
				t.Errorf("%s: berth controller does not know %q (see berth controller --help)", what, a)
			}
		}
	}
}
