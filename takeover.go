package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/internal/kubeapi"
)

// takeoverFromKubernetes is berth serve's flag that makes the Kubernetes
// API an authority for takeovers.
const takeoverFromKubernetes = "takeover-from-kubernetes"

func takeoverFlag() cli.Flag {
	return &cli.BoolFlag{Name: takeoverFromKubernetes, EnvVars: []string{"BERTH_TAKEOVER_FROM_KUBERNETES"}, Usage: "let a stage that finds another node's reservation preempt it when the Kubernetes API shows the volume moved here (this node's VolumeAttachment attached; the holder's gone, or its Node deleted or tainted node.kubernetes.io/out-of-service); needs the pod's service-account token and RBAC get and list on volumeattachments and nodes"}
}

// kubeTakeover is the Kubernetes API as an agent.TakeoverAuthority.
type kubeTakeover struct {
	nodeID string
	k      *kubeapi.Takeover
}

var _ agent.TakeoverAuthority = kubeTakeover{}

// newKubeTakeover is the authority of --takeover-from-kubernetes for
// node nodeID, from the pod's environment.
func newKubeTakeover(driver, nodeID string) (kubeTakeover, error) {
	k, err := kubeapi.NewInCluster(kubeapi.Config{DriverName: driver, NodeName: nodeID, NodeKey: agent.NodeKey})
	if err != nil {
		return kubeTakeover{}, err
	}
	return kubeTakeover{nodeID: nodeID, k: k}, nil
}

// AuthorizeTakeover never returns an error: an API that cannot be asked
// is a refusal, with its reason.
func (t kubeTakeover) AuthorizeTakeover(ctx context.Context, req agent.TakeoverRequest) (agent.TakeoverDecision, error) {
	if req.NodeID != t.nodeID {
		return agent.TakeoverDecision{Reason: fmt.Sprintf("asked for node %q, but this authority answers for node %q", req.NodeID, t.nodeID)}, nil
	}
	d := t.k.Authorize(ctx, req.VolumeID, req.Holder)
	return agent.TakeoverDecision{Allowed: d.Allowed, HolderNode: d.HolderNode, Reason: d.Reason}, nil
}

// takeoverCheckCommand asks the authorities berth serve would ask,
// without staging anything: for an operator who wants to know why a
// stage was refused, or whether a move would be allowed now.
func takeoverCheckCommand() *cli.Command {
	return &cli.Command{
		Name:      "takeover-check",
		Usage:     "ask the Kubernetes API, as a stage would, whether this node may take a volume from the node holding its reservation",
		ArgsUsage: "VOLUME_ID HOLDER",
		Description: "HOLDER is the holding node's name or its reservation key (0xb3e7...). Run it inside the berth-node pod\n" +
			"(kubectl exec), where the service-account token and the API server's address are. It changes\n" +
			"nothing: it prints the decision and its reason, and exits 1 when the takeover is not allowed.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "node-id", Value: defaultNodeID(), EnvVars: []string{"BERTH_NODE_ID"}, Usage: "this node's ID, as berth serve's --node-id"},
			&cli.StringFlag{Name: "driver-name", Value: agent.DefaultDriverName, EnvVars: []string{"BERTH_DRIVER_NAME"}, Usage: "CSI driver name"},
		},
		Action: func(c *cli.Context) error {
			if c.NArg() != 2 {
				return fmt.Errorf("want VOLUME_ID HOLDER (a node name or a reservation key), got %d arguments", c.NArg())
			}
			holder := parseHolder(c.Args().Get(1))
			var auth agent.TakeoverAuthority
			auth, err := newKubeTakeover(c.String("driver-name"), c.String("node-id"))
			if err != nil {
				return err
			}
			d, err := auth.AuthorizeTakeover(c.Context, agent.TakeoverRequest{VolumeID: c.Args().Get(0), NodeID: c.String("node-id"), Holder: holder})
			if err != nil {
				return err
			}
			verdict := "refused"
			if d.Allowed {
				verdict = "allowed"
			}
			fmt.Fprintf(c.App.Writer, "%s: %s\n", verdict, d.Reason)
			if !d.Allowed {
				return cli.Exit("", 1)
			}
			return nil
		},
	}
}

// parseHolder reads a reservation key (hex, 0x...) or else takes s as a
// node name and derives its key.
func parseHolder(s string) uint64 {
	if h, ok := strings.CutPrefix(strings.ToLower(s), "0x"); ok {
		if k, err := strconv.ParseUint(h, 16, 64); err == nil {
			return k
		}
	}
	return agent.NodeKey(s)
}
