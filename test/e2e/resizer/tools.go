//go:build tools

// Package resizer pins csi-resizer, which make e2e builds, so that go mod tidy keeps
// its dependencies.
package resizer

import _ "github.com/kubernetes-csi/external-resizer/cmd/csi-resizer"
