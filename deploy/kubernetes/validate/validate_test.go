package validate

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/nvmeof"
)

const (
	manifestDir  = ".."
	driver       = agent.DefaultDriverName
	kubeletDir   = "/var/lib/kubelet"
	registration = kubeletDir + "/plugins/" + driver + "/csi.sock"
)

// object is one decoded document and where it came from.
type object struct {
	where string
	obj   any
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// blank reports whether a YAML document holds only comments and space.
func blank(doc []byte) bool {
	for _, l := range strings.Split(string(doc), "\n") {
		l = strings.TrimSpace(l)
		if l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// decode strictly decodes every document of file into its typed struct.
func decode(t *testing.T, file string) []object {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return decodeBytes(t, filepath.Base(file), data)
}

func decodeBytes(t *testing.T, name string, data []byte) []object {
	t.Helper()
	var out []object
	for i, doc := range docSep.Split(string(data), -1) {
		if blank([]byte(doc)) {
			continue
		}
		where := fmt.Sprintf("%s document %d", name, i+1)
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		var obj any
		switch tm.APIVersion + " " + tm.Kind {
		case "storage.k8s.io/v1 CSIDriver":
			obj = &storagev1.CSIDriver{}
		case "apps/v1 DaemonSet":
			obj = &appsv1.DaemonSet{}
		case "apps/v1 Deployment":
			obj = &appsv1.Deployment{}
		case "rbac.authorization.k8s.io/v1 ClusterRole":
			obj = &rbacv1.ClusterRole{}
		case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		case "rbac.authorization.k8s.io/v1 Role":
			obj = &rbacv1.Role{}
		case "rbac.authorization.k8s.io/v1 RoleBinding":
			obj = &rbacv1.RoleBinding{}
		case "v1 ServiceAccount":
			obj = &corev1.ServiceAccount{}
		case "v1 ConfigMap":
			obj = &corev1.ConfigMap{}
		case "v1 Secret":
			obj = &corev1.Secret{}
		case "v1 PersistentVolume":
			obj = &corev1.PersistentVolume{}
		case "v1 PersistentVolumeClaim":
			obj = &corev1.PersistentVolumeClaim{}
		case "v1 Pod":
			obj = &corev1.Pod{}
		default:
			t.Fatalf("%s: unexpected apiVersion/kind %q %q", where, tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("%s (%s): %v", where, tm.Kind, err)
		}
		if err := sameKeys([]byte(doc), obj); err != nil {
			t.Fatalf("%s (%s): %v", where, tm.Kind, err)
		}
		out = append(out, object{where, obj})
	}
	return out
}

// sameKeys catches what encoding/json forgives: it matches field names
// case-insensitively, so "hostPId" would fill HostPID while the API server
// rejects it. Every key of the document must come back, spelt the same,
// when the typed object is encoded again.
func sameKeys(doc []byte, obj any) error {
	var orig, round any
	if err := yaml.Unmarshal(doc, &orig); err != nil {
		return err
	}
	enc, err := yaml.Marshal(obj)
	if err != nil {
		return err
	}
	if err := yaml.Unmarshal(enc, &round); err != nil {
		return err
	}
	return compareKeys(orig, round, "")
}

func compareKeys(orig, round any, path string) error {
	switch o := orig.(type) {
	case map[string]any:
		r, _ := round.(map[string]any)
		for k, v := range o {
			rv, ok := r[k]
			if !ok {
				return fmt.Errorf("field %s%s is unknown (check its spelling and case) or a zero value the API drops", path, k)
			}
			if err := compareKeys(v, rv, path+k+"."); err != nil {
				return err
			}
		}
	case []any:
		r, _ := round.([]any)
		for i, v := range o {
			if i >= len(r) {
				return fmt.Errorf("field %s[%d] lost", path, i)
			}
			if err := compareKeys(v, r[i], fmt.Sprintf("%s[%d].", strings.TrimSuffix(path, "."), i)); err != nil {
				return err
			}
		}
	}
	return nil
}

func decodeAll(t *testing.T, files []string) []object {
	var all []object
	for _, f := range files {
		all = append(all, decode(t, f)...)
	}
	return all
}

func only[T any](t *testing.T, objs []object) []*T {
	var out []*T
	for _, o := range objs {
		if v, ok := o.obj.(*T); ok {
			out = append(out, v)
		}
	}
	return out
}

// kustomizeResources returns the files kustomization.yaml deploys.
func kustomizeResources(t *testing.T) []string {
	data, err := os.ReadFile(filepath.Join(manifestDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Resources []string `json:"resources"`
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	var files []string
	for _, r := range k.Resources {
		files = append(files, filepath.Join(manifestDir, r))
	}
	return files
}

func TestDeployment(t *testing.T) {
	files := kustomizeResources(t)
	// Every manifest in the directory is deployed.
	all, _ := filepath.Glob(filepath.Join(manifestDir, "*.yaml"))
	for _, f := range all {
		if filepath.Base(f) != "kustomization.yaml" && !slices.Contains(files, f) {
			t.Errorf("%s is not listed in kustomization.yaml", f)
		}
	}
	objs := deployedObjects(t)

	drivers := only[storagev1.CSIDriver](t, objs)
	if len(drivers) != 1 {
		t.Fatalf("%d CSIDrivers, want 1", len(drivers))
	}
	d := drivers[0]
	if d.Name != driver {
		t.Errorf("CSIDriver name %q, want %q (agent.DefaultDriverName)", d.Name, driver)
	}
	if d.Spec.AttachRequired == nil || !*d.Spec.AttachRequired {
		t.Error("CSIDriver attachRequired must be true: without attach Kubernetes does no Multi-Attach check, and a ReadWriteOnce volume is staged on two nodes")
	}
	if d.Spec.PodInfoOnMount == nil || *d.Spec.PodInfoOnMount {
		t.Error("CSIDriver podInfoOnMount must be false")
	}
	if d.Spec.FSGroupPolicy == nil || *d.Spec.FSGroupPolicy != storagev1.FileFSGroupPolicy {
		t.Error("CSIDriver fsGroupPolicy must be File")
	}

	sas := only[corev1.ServiceAccount](t, objs)
	dss := only[appsv1.DaemonSet](t, objs)
	if len(dss) != 1 || len(sas) != 2 {
		t.Fatalf("%d DaemonSets, %d ServiceAccounts; want 1 and 2 (the node's, the controller's)", len(dss), len(sas))
	}
	ds := dss[0]
	spec := ds.Spec.Template.Spec
	if !slices.ContainsFunc(sas, func(sa *corev1.ServiceAccount) bool {
		return sa.Name == spec.ServiceAccountName && sa.Namespace == ds.Namespace
	}) {
		t.Errorf("DaemonSet uses service account %s/%s, which the manifests do not define", ds.Namespace, spec.ServiceAccountName)
	}
	for k, v := range ds.Spec.Selector.MatchLabels {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("selector %s=%s does not match the pod template", k, v)
		}
	}
	if !spec.HostNetwork {
		t.Error("hostNetwork must be true: iscsid's abstract socket and kernel uevents live in the host's network namespace")
	}
	if !spec.HostPID {
		t.Error("hostPID must be true: the iscsiadm wrapper enters PID 1's namespaces")
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q, want system-node-critical", spec.PriorityClassName)
	}
	tolerateAll := false
	for _, tol := range spec.Tolerations {
		if tol.Operator == corev1.TolerationOpExists && tol.Key == "" && tol.Effect == "" {
			tolerateAll = true
		}
	}
	if !tolerateAll {
		t.Error("tolerations must include {operator: Exists} (every taint)")
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	hostPathOf := func(c corev1.Container, mountPath string) (corev1.VolumeMount, string) {
		for _, m := range c.VolumeMounts {
			if m.MountPath == mountPath {
				v := volumes[m.Name]
				if v.HostPath == nil {
					return m, ""
				}
				return m, v.HostPath.Path
			}
		}
		return corev1.VolumeMount{}, ""
	}
	containers := map[string]corev1.Container{}
	for _, c := range spec.Containers {
		containers[c.Name] = c
		privileged := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
		for _, m := range c.VolumeMounts {
			if _, ok := volumes[m.Name]; !ok {
				t.Errorf("container %s mounts undefined volume %s", c.Name, m.Name)
			}
			if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional && !privileged {
				t.Errorf("container %s: Bidirectional propagation on %s needs privileged", c.Name, m.MountPath)
			}
		}
	}

	berth, ok := containers["berth"]
	if !ok {
		t.Fatal("no container named berth")
	}
	if berth.SecurityContext == nil || berth.SecurityContext.Privileged == nil || !*berth.SecurityContext.Privileged {
		t.Error("berth container must be privileged")
	}
	m, hp := hostPathOf(berth, kubeletDir)
	if hp != kubeletDir || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional {
		t.Errorf("berth must mount host %s at %s with Bidirectional propagation; got host %q, %+v", kubeletDir, kubeletDir, hp, m)
	}
	for path, ro := range map[string]bool{
		"/dev": false, "/sys": false, "/run/udev": true, "/etc/iscsi": false, "/etc/nvme": false,
		"/lib/modules": true, "/var/lib/berth": false, "/run/lock/iscsi": false,
	} {
		m, hp := hostPathOf(berth, path)
		if hp != path || m.ReadOnly != ro {
			t.Errorf("berth must mount host %s at %s (readOnly %v); got host %q, %+v", path, path, ro, hp, m)
		}
	}
	flag := argValue
	if len(berth.Args) == 0 || berth.Args[0] != "serve" {
		t.Errorf("berth args %v: want the serve command first", berth.Args)
	}
	if ep, _ := flag(berth, "--endpoint"); ep != "unix://"+registration {
		t.Errorf("berth --endpoint %q: want unix://%s, the path the kubelet dials", ep, registration)
	}
	if dn, ok := flag(berth, "--driver-name"); ok && dn != driver {
		t.Errorf("berth --driver-name %q, CSIDriver is %q", dn, driver)
	}
	if id, _ := flag(berth, "--node-id"); id != "$(NODE_NAME)" {
		t.Errorf("berth --node-id %q: want $(NODE_NAME)", id)
	} else if len(berth.Env) == 0 || berth.Env[0].Name != "NODE_NAME" || berth.Env[0].ValueFrom == nil ||
		berth.Env[0].ValueFrom.FieldRef == nil || berth.Env[0].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Error("NODE_NAME must come from spec.nodeName")
	}

	// berth registers itself: its registration socket is under the
	// kubelet directory it mounts from the host, at the kubelet's path.
	if _, ok := flag(berth, "--kubelet-registration"); !ok {
		t.Error("berth runs without --kubelet-registration, and no registrar runs beside it")
	}
	kd, ok := flag(berth, "--kubelet-dir")
	if !ok {
		for _, e := range berth.Env {
			if e.Name == "BERTH_KUBELET_DIR" {
				kd, ok = e.Value, true
			}
		}
	}
	if !ok || kd != kubeletDir {
		t.Errorf("berth's --kubelet-dir (or BERTH_KUBELET_DIR) %q, want %s, which it mounts at its own path", kd, kubeletDir)
	}

	lp, ok := containers["liveness-probe"]
	if !ok {
		t.Fatal("no liveness-probe container")
	}
	addr, _ := flag(lp, "--csi-address")
	if _, hp := hostPathOf(lp, filepath.Dir(addr)); hp != filepath.Dir(registration) {
		t.Errorf("livenessprobe --csi-address %s does not reach berth's socket (host %q)", addr, hp)
	}
	ep, _ := flag(lp, "--http-endpoint")
	probe := berth.LivenessProbe
	if probe == nil || probe.HTTPGet == nil {
		t.Fatal("berth has no httpGet livenessProbe")
	}
	if got := fmt.Sprintf("%s:%s", probe.HTTPGet.Host, probe.HTTPGet.Port.String()); got != ep || probe.HTTPGet.Path != "/healthz" {
		t.Errorf("berth livenessProbe GETs %s%s, the livenessprobe sidecar serves %s/healthz", got, probe.HTTPGet.Path, ep)
	}
}

// The systemd socket unit serves on the same path the DaemonSet registers,
// so both deployments present one driver to the kubelet.
func TestSystemdSocketAgrees(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(manifestDir, "..", "..", "systemd", "berth.socket"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(data, []byte("\nListenStream="+registration+"\n")) {
		t.Errorf("systemd/berth.socket does not listen on %s", registration)
	}
}

func TestExamples(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(manifestDir, "examples", "*.yaml"))
	if len(files) == 0 {
		t.Fatal("no examples")
	}
	transports := map[string]bool{}
	for _, f := range files {
		objs := decodeAll(t, []string{f})
		secrets := map[string]map[string]string{}
		for _, s := range only[corev1.Secret](t, objs) {
			data := map[string]string{}
			for k, v := range s.Data {
				data[k] = string(v)
			}
			for k, v := range s.StringData {
				data[k] = v
			}
			secrets[s.Namespace+"/"+s.Name] = data
		}
		pvs := map[string]*corev1.PersistentVolume{}
		for _, pv := range only[corev1.PersistentVolume](t, objs) {
			pvs[pv.Name] = pv
			where := filepath.Base(f) + " PV " + pv.Name
			c := pv.Spec.CSI
			if c == nil || c.Driver != driver || c.VolumeHandle == "" {
				t.Errorf("%s: want csi driver %s with a volumeHandle", where, driver)
				continue
			}
			block := pv.Spec.VolumeMode != nil && *pv.Spec.VolumeMode == corev1.PersistentVolumeBlock
			if !block && c.FSType != "ext4" && c.FSType != "xfs" {
				t.Errorf("%s: fsType %q, want ext4 or xfs", where, c.FSType)
			}
			var sec map[string]string
			if r := c.NodeStageSecretRef; r != nil {
				if sec = secrets[r.Namespace+"/"+r.Name]; sec == nil {
					t.Errorf("%s: nodeStageSecretRef %s/%s not in the example", where, r.Namespace, r.Name)
				}
			}
			// What the stage parses: the volume attributes and berth
			// controller's publish_context.
			va := maps.Clone(c.VolumeAttributes)
			va[agent.PublishContextNode] = "node-a"
			switch {
			case va["transport"] == "iscsi" || va["iqn"] != "" || va["targetPortal"] != "":
				transports["iscsi"] = true
				if _, err := iscsi.ParseVolume(va, sec); err != nil {
					t.Errorf("%s: berth's iSCSI transport refuses the volumeAttributes: %v", where, err)
				}
			case va["transport"] == "nvmeof" || va["nqn"] != "" || va["targetTrAddr"] != "":
				transports["nvmeof"] = true
				if _, err := nvmeof.ParseVolumeContext(va); err != nil {
					t.Errorf("%s: berth's NVMe-oF transport refuses the volumeAttributes: %v", where, err)
				}
			default:
				t.Errorf("%s: volumeAttributes %v name no transport", where, va)
			}
		}
		pvcs := map[string]*corev1.PersistentVolumeClaim{}
		for _, pvc := range only[corev1.PersistentVolumeClaim](t, objs) {
			pvcs[pvc.Name] = pvc
			pv := pvs[pvc.Spec.VolumeName]
			if pv == nil {
				t.Errorf("%s PVC %s: volumeName %q is no PV of the example", filepath.Base(f), pvc.Name, pvc.Spec.VolumeName)
				continue
			}
			if pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != "" {
				t.Errorf("PVC %s: storageClassName must be \"\" so no provisioner takes it", pvc.Name)
			}
			if mode := func(m *corev1.PersistentVolumeMode) corev1.PersistentVolumeMode {
				if m == nil {
					return corev1.PersistentVolumeFilesystem
				}
				return *m
			}; mode(pvc.Spec.VolumeMode) != mode(pv.Spec.VolumeMode) {
				t.Errorf("PVC %s and PV %s differ in volumeMode", pvc.Name, pv.Name)
			}
		}
		for _, pod := range only[corev1.Pod](t, objs) {
			for _, v := range pod.Spec.Volumes {
				if v.PersistentVolumeClaim != nil && pvcs[v.PersistentVolumeClaim.ClaimName] == nil {
					t.Errorf("pod %s claims %q, not a PVC of the example", pod.Name, v.PersistentVolumeClaim.ClaimName)
				}
			}
		}
	}
	for _, tr := range []string{"iscsi", "nvmeof"} {
		if !transports[tr] {
			t.Errorf("no example for %s", tr)
		}
	}
}
