// Package validate checks berth's Kubernetes manifests: every document is
// decoded strictly into the k8s.io/api types (an unknown or misspelt field
// is an error), the properties berth depends on are asserted, and the
// examples' volumeAttributes are parsed by berth's own transports.
//
// The objects checked are the rendered ones: [Kustomize] renders the base
// as kustomize build does for the features it uses (resources, images,
// replacements, local-config), and [Helm] renders deploy/helm/berth as
// helm template does for the template functions it allows (default,
// quote); a test compares the two object sets field by field. Neither tool
// is needed, and a feature outside those subsets fails to render rather
// than being skipped.
//
// It is a module of its own so that berth's module does not require the
// Kubernetes API types. Run it with:
//
//	cd deploy/kubernetes/validate && go test -count=1 ./...
package validate
