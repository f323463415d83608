// Package validate checks berth's Kubernetes manifests as they are
// deployed: the kustomize base rendered by kustomize build and the chart
// rendered by helm template (after helm lint), every document decoded
// strictly into the k8s.io/api types (an unknown or misspelt field is an
// error), the properties berth depends on asserted, the chart's and the
// base's objects compared field by field, the berth container's arguments
// checked against berth serve --help, and the examples' volumeAttributes
// parsed by berth's own transports.
//
// It is a module of its own so that berth's module does not require the
// Kubernetes API types. make manifest-test installs the pinned helm and
// kustomize and runs it; by hand, name them (or have them on PATH):
//
//	cd deploy/kubernetes/validate && BERTH_HELM=... BERTH_KUSTOMIZE=... go test -count=1 ./...
package validate
