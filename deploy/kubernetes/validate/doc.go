// Package validate checks berth's Kubernetes manifests: every document is
// decoded strictly into the k8s.io/api types (an unknown or misspelt field
// is an error), the properties berth depends on are asserted, and the
// examples' volumeAttributes are parsed by berth's own transports.
//
// It is a module of its own so that berth's module does not require the
// Kubernetes API types. Run it with:
//
//	cd deploy/kubernetes/validate && go test -count=1 ./...
package validate
