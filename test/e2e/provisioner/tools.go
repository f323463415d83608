//go:build tools

// Package provisioner pins csi-provisioner, which make e2e builds, so that go mod tidy keeps
// its dependencies.
package provisioner

import _ "github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner"
