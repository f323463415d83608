package systemd

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// ProbeEndpoint returns a LivenessCheck that opens a new connection to the
// unix socket at path and calls CSI Identity Probe, as the kubelet's
// livenessprobe sidecar would. A new connection every time exercises the
// accept loop as well as the handlers; a wedged server makes the call hang
// until ctx ends. A Probe answering ready=false still counts as alive: the
// process serves, and readiness is the kubelet's concern, not systemd's.
func ProbeEndpoint(path string) LivenessCheck {
	return func(ctx context.Context) error {
		conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return fmt.Errorf("liveness probe %s: %w", path, err)
		}
		defer conn.Close()
		if _, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}); err != nil {
			return fmt.Errorf("liveness probe %s: %w", path, err)
		}
		return nil
	}
}
