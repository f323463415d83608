//go:build tools

// Package attacher pins csi-attacher, which make e2e builds, so that go mod tidy keeps
// its dependencies.
package attacher

import _ "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher"
