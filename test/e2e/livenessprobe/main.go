// Command livenessprobe answers the DaemonSet's liveness check in make e2e,
// in place of the kubernetes-csi livenessprobe sidecar (whose image the e2e
// cluster cannot pull and whose module the proxy does not serve). It takes
// the same flags the DaemonSet passes and does what that sidecar does: GET
// /healthz calls CSI Probe on the driver's socket and answers 200 when the
// driver is ready, 500 otherwise.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/http"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	addr := flag.String("csi-address", "/csi/csi.sock", "the driver's CSI socket")
	endpoint := flag.String("http-endpoint", "127.0.0.1:9808", "address to serve /healthz on")
	timeout := flag.Duration("probe-timeout", time.Second, "timeout of one CSI Probe")
	flag.Parse()
	conn, err := grpc.NewClient("unix://"+*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	id := csi.NewIdentityClient(conn)
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), *timeout)
		defer cancel()
		resp, err := id.Probe(ctx, &csi.ProbeRequest{})
		switch {
		case err != nil:
			http.Error(w, fmt.Sprintf("probe: %v", err), http.StatusInternalServerError)
		case resp.GetReady() != nil && !resp.GetReady().GetValue():
			http.Error(w, "driver not ready", http.StatusInternalServerError)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	log.Fatal(http.ListenAndServe(*endpoint, nil))
}
