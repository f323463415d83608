package validate

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"text/template"

	"sigs.k8s.io/yaml"
)

// Object is one rendered Kubernetes object, as decoded from YAML.
type Object = map[string]any

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// SplitDocuments decodes every non-empty document of a YAML stream.
func SplitDocuments(data []byte) ([]Object, error) {
	var out []Object
	for i, doc := range docSeparator.Split(string(data), -1) {
		var o Object
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		if len(o) > 0 {
			out = append(out, o)
		}
	}
	return out, nil
}

// kustomization is the part of kustomize's Kustomization that berth's
// base uses. It is decoded strictly: a field outside this subset (a
// patch, a generator, a namespace) is an error, not silently skipped, so
// that what the tests check is what kubectl apply -k deploys.
type kustomization struct {
	APIVersion   string        `json:"apiVersion"`
	Kind         string        `json:"kind"`
	Resources    []string      `json:"resources"`
	Images       []kImage      `json:"images"`
	Replacements []replacement `json:"replacements"`
}

type kImage struct {
	Name    string `json:"name"`
	NewName string `json:"newName"`
	NewTag  string `json:"newTag"`
}

type replacement struct {
	Source struct {
		Kind      string `json:"kind"`
		Name      string `json:"name"`
		FieldPath string `json:"fieldPath"`
	} `json:"source"`
	Targets []struct {
		Select struct {
			Kind string `json:"kind"`
			Name string `json:"name"`
		} `json:"select"`
		FieldPaths []string `json:"fieldPaths"`
		Options    *struct {
			Delimiter string `json:"delimiter"`
			Index     int    `json:"index"`
		} `json:"options"`
	} `json:"targets"`
}

// KustomizeResources lists the files dir's kustomization.yaml deploys.
func KustomizeResources(dir string) ([]string, error) {
	k, err := readKustomization(dir)
	if err != nil {
		return nil, err
	}
	var files []string
	for _, r := range k.Resources {
		files = append(files, filepath.Join(dir, r))
	}
	return files, nil
}

func readKustomization(dir string) (*kustomization, error) {
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		return nil, err
	}
	var k kustomization
	if err := yaml.UnmarshalStrict(data, &k); err != nil {
		return nil, fmt.Errorf("kustomization.yaml (only resources, images and replacements are understood here): %w", err)
	}
	if k.Kind != "Kustomization" || len(k.Resources) == 0 {
		return nil, fmt.Errorf("kustomization.yaml: kind %q, %d resources", k.Kind, len(k.Resources))
	}
	return &k, nil
}

// Kustomize renders dir as kustomize build would for the subset above:
// the resources, the replacements, the image transformer; objects
// annotated config.kubernetes.io/local-config are left out.
func Kustomize(dir string) ([]Object, error) {
	k, err := readKustomization(dir)
	if err != nil {
		return nil, err
	}
	var objs []Object
	for _, r := range k.Resources {
		data, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			return nil, err
		}
		docs, err := SplitDocuments(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", r, err)
		}
		objs = append(objs, docs...)
	}
	for _, rep := range k.Replacements {
		src := find(objs, rep.Source.Kind, rep.Source.Name)
		if src == nil {
			return nil, fmt.Errorf("replacement source %s/%s: no such resource", rep.Source.Kind, rep.Source.Name)
		}
		value, err := getField(src, rep.Source.FieldPath)
		if err != nil {
			return nil, fmt.Errorf("replacement source %s/%s: %w", rep.Source.Kind, rep.Source.Name, err)
		}
		for _, tgt := range rep.Targets {
			obj := find(objs, tgt.Select.Kind, tgt.Select.Name)
			if obj == nil {
				return nil, fmt.Errorf("replacement target %s/%s: no such resource", tgt.Select.Kind, tgt.Select.Name)
			}
			for _, fp := range tgt.FieldPaths {
				v := value
				if o := tgt.Options; o != nil && o.Delimiter != "" {
					old, err := getField(obj, fp)
					if err != nil {
						return nil, err
					}
					s, _ := old.(string)
					parts := strings.Split(s, o.Delimiter)
					if o.Index < 0 || o.Index >= len(parts) {
						return nil, fmt.Errorf("%s %q: no part %d around %q", fp, s, o.Index, o.Delimiter)
					}
					parts[o.Index] = fmt.Sprint(value)
					v = strings.Join(parts, o.Delimiter)
				}
				if err := setField(obj, fp, v); err != nil {
					return nil, fmt.Errorf("replacement target %s/%s: %w", tgt.Select.Kind, tgt.Select.Name, err)
				}
			}
		}
	}
	var out []Object
	for _, o := range objs {
		if a, _ := getField(o, "metadata.annotations"); a != nil {
			if a.(map[string]any)["config.kubernetes.io/local-config"] == "true" {
				continue
			}
		}
		for _, img := range k.Images {
			setImages(o, img)
		}
		out = append(out, o)
	}
	return out, nil
}

func find(objs []Object, kind, name string) Object {
	for _, o := range objs {
		if n, _ := getField(o, "metadata.name"); o["kind"] == kind && n == name {
			return o
		}
	}
	return nil
}

// splitPath splits a kustomize field path (a.b.[name=x].c); selectors may
// hold dots.
func splitPath(p string) []string {
	var out []string
	var cur strings.Builder
	depth := 0
	for _, r := range p {
		switch {
		case r == '[':
			depth++
		case r == ']':
			depth--
		case r == '.' && depth == 0:
			out = append(out, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteRune(r)
	}
	return append(out, cur.String())
}

// walk returns the map that holds the last segment of path, and that key.
func walk(obj Object, path string) (map[string]any, string, error) {
	segs := splitPath(path)
	var cur any = obj
	for _, s := range segs[:len(segs)-1] {
		if sel, ok := strings.CutPrefix(s, "["); ok {
			k, v, _ := strings.Cut(strings.TrimSuffix(sel, "]"), "=")
			list, _ := cur.([]any)
			var next any
			for _, e := range list {
				if m, ok := e.(map[string]any); ok && m[k] == v {
					next = m
				}
			}
			if next == nil {
				return nil, "", fmt.Errorf("field %s: no element [%s=%s]", path, k, v)
			}
			cur = next
			continue
		}
		m, ok := cur.(map[string]any)
		if !ok || m[s] == nil {
			return nil, "", fmt.Errorf("field %s: no %s", path, s)
		}
		cur = m[s]
	}
	m, ok := cur.(map[string]any)
	if !ok {
		return nil, "", fmt.Errorf("field %s: not an object", path)
	}
	return m, segs[len(segs)-1], nil
}

func getField(obj Object, path string) (any, error) {
	m, k, err := walk(obj, path)
	if err != nil {
		return nil, err
	}
	return m[k], nil
}

// setField replaces an existing field; it never creates one (kustomize's
// default, create: false), so a path that no longer matches fails.
func setField(obj Object, path string, v any) error {
	m, k, err := walk(obj, path)
	if err != nil {
		return err
	}
	if _, ok := m[k]; !ok {
		return fmt.Errorf("field %s does not exist", path)
	}
	m[k] = v
	return nil
}

// splitImage splits an image reference into name and tag (a registry's
// port is part of the name).
func splitImage(ref string) (name, tag string) {
	slash := strings.LastIndex(ref, "/")
	if i := strings.LastIndex(ref, ":"); i > slash {
		return ref[:i], ref[i+1:]
	}
	return ref, ""
}

func setImages(o Object, img kImage) {
	spec, err := getField(o, "spec.template.spec")
	if err != nil || spec == nil {
		return
	}
	for _, list := range []string{"containers", "initContainers"} {
		cs, _ := spec.(map[string]any)[list].([]any)
		for _, c := range cs {
			c := c.(map[string]any)
			name, tag := splitImage(fmt.Sprint(c["image"]))
			if name != img.Name {
				continue
			}
			if img.NewName != "" {
				name = img.NewName
			}
			if img.NewTag != "" {
				tag = img.NewTag
			}
			if tag != "" {
				name += ":" + tag
			}
			c["image"] = name
		}
	}
}

// chart is the part of Chart.yaml berth's chart uses.
type chart struct {
	APIVersion  string `json:"apiVersion"`
	Name        string `json:"name"`
	Description string `json:"description"`
	Type        string `json:"type"`
	Version     string `json:"version"`
	AppVersion  string `json:"appVersion"`
	KubeVersion string `json:"kubeVersion"`
}

// helmFuncs are the only template functions the chart may use: Helm's
// default and quote (from sprig). A template calling anything else does
// not parse here, which keeps the chart within what this renderer does
// exactly as Helm does.
var helmFuncs = template.FuncMap{
	"default": func(def any, v ...any) any {
		if len(v) == 0 || empty(v[0]) {
			return def
		}
		return v[0]
	},
	"quote": func(v any) string { return fmt.Sprintf("%q", fmt.Sprint(v)) },
}

func empty(v any) bool {
	switch x := v.(type) {
	case nil:
		return true
	case string:
		return x == ""
	case bool:
		return !x
	case float64:
		return x == 0
	case int:
		return x == 0
	case map[string]any:
		return len(x) == 0
	case []any:
		return len(x) == 0
	}
	return false
}

// Helm renders the chart in dir as helm template would, with the release
// in namespace and set merged over values.yaml.
func Helm(dir, release, namespace string, set map[string]any) ([]Object, error) {
	data, err := os.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, err
	}
	var c chart
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		return nil, fmt.Errorf("Chart.yaml: %w", err)
	}
	if c.APIVersion != "v2" || c.Name == "" || c.Version == "" {
		return nil, fmt.Errorf("Chart.yaml: apiVersion %q, name %q, version %q", c.APIVersion, c.Name, c.Version)
	}
	data, err = os.ReadFile(filepath.Join(dir, "values.yaml"))
	if err != nil {
		return nil, err
	}
	values := map[string]any{}
	if err := yaml.Unmarshal(data, &values); err != nil {
		return nil, fmt.Errorf("values.yaml: %w", err)
	}
	merge(values, set)
	top := map[string]any{
		"Values":  values,
		"Release": map[string]any{"Name": release, "Namespace": namespace, "Service": "Helm"},
		"Chart":   map[string]any{"Name": c.Name, "Version": c.Version, "AppVersion": c.AppVersion},
	}
	files, err := filepath.Glob(filepath.Join(dir, "templates", "*"))
	if err != nil {
		return nil, err
	}
	sort.Strings(files)
	var out []Object
	for _, f := range files {
		base := filepath.Base(f)
		if strings.HasPrefix(base, "_") || base == "NOTES.txt" {
			return nil, fmt.Errorf("%s: helpers and notes are not rendered here; keep the templates plain", base)
		}
		if !strings.HasSuffix(base, ".yaml") {
			return nil, fmt.Errorf("%s: not a .yaml template", base)
		}
		src, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		t, err := template.New(base).Funcs(helmFuncs).Option("missingkey=error").Parse(string(src))
		if err != nil {
			return nil, fmt.Errorf("template %s: %w", base, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, top); err != nil {
			return nil, fmt.Errorf("template %s: %w", base, err)
		}
		docs, err := SplitDocuments(b.Bytes())
		if err != nil {
			return nil, fmt.Errorf("template %s renders: %w", base, err)
		}
		out = append(out, docs...)
	}
	if len(out) == 0 {
		return nil, errors.New("the chart renders nothing")
	}
	return out, nil
}

// merge sets src's values over dst, recursing into maps.
func merge(dst, src map[string]any) {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

// ObjectKey names an object: apiVersion, kind, namespace and name.
func ObjectKey(o Object) string {
	ns, _ := getField(o, "metadata.namespace")
	name, _ := getField(o, "metadata.name")
	return fmt.Sprintf("%v %v %v/%v", o["apiVersion"], o["kind"], ns, name)
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
	keys := slices.Sorted(maps.Keys(am))
	for _, k := range keys {
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
		for k := range bv {
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
