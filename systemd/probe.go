package systemd

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// ProbeEndpoint returns a LivenessCheck that opens a new connection to the
// unix socket at path and calls CSI Identity Probe, as the kubelet's
// livenessprobe sidecar would. A new connection every time exercises the
// accept loop as well as the handlers; a wedged server makes the call hang
// until ctx ends. Any answer from the server counts as alive, including
// ready=false and an error status such as FailedPrecondition from a node
// check (iscsid stopped): the process serves, and a restart would not fix
// the node. Only no answer (Unavailable, DeadlineExceeded, Canceled) fails.
func ProbeEndpoint(path string) LivenessCheck {
	return func(ctx context.Context) error {
		conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return fmt.Errorf("liveness probe %s: %w", path, err)
		}
		defer conn.Close()
		_, err = csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		switch status.Code(err) {
		case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
			return fmt.Errorf("liveness probe %s: %w", path, err)
		}
		return nil
	}
}
