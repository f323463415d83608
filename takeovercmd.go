package main

import (
	"fmt"
	"strconv"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/internal/cliflags"
)

func takeoverCommand() *cli.Command {
	return &cli.Command{
		Name:      "takeover",
		Usage:     "authorise the next stage of a volume on this node to preempt the node that holds its reservation",
		UsageText: "berth takeover [--state-dir DIR] --volume-id ID (--from-node NODE | --from-key KEY) [--valid-for 10m]",
		Description: `Run it on the node that is to take the volume over, once the node that holds
it is known to be down or cut off (stopped, partitioned, its pods gone): the
next NodeStageVolume of the volume here then preempts that node's reservation
at the target and aborts its queued commands, so that none of its writes
reaches the storage from then on. It writes a one-shot authorisation under
berth's state directory; the stage consumes it. It names the holder: a stage
that finds the volume held by another node is not authorised. An
authorisation not used within --valid-for expires. It changes nothing at the
target by itself and runs beside berth serve.`,
		Flags: []cli.Flag{
			cliflags.StateDirFlag(),
			&cli.StringFlag{Name: "volume-id", Required: true, Usage: "the volume to take over"},
			&cli.StringFlag{Name: "from-node", Usage: "the node ID (berth serve --node-id) that holds it"},
			&cli.StringFlag{Name: "from-key", Usage: "the reservation key that holds it (0xb3e7…), where its node is not known"},
			&cli.DurationFlag{Name: "valid-for", Value: 10 * time.Minute, Usage: "how long the authorisation waits for the stage"},
		},
		Action: func(c *cli.Context) error {
			if c.NArg() > 0 {
				return cli.Exit(fmt.Sprintf("berth takeover: unexpected argument %q", c.Args().First()), 2)
			}
			t := agent.OperatorTakeover{VolumeID: c.String("volume-id"), FromNode: c.String("from-node"), Expires: time.Now().Add(c.Duration("valid-for"))}
			if s := c.String("from-key"); s != "" {
				k, err := strconv.ParseUint(s, 0, 64)
				if err != nil {
					return cli.Exit(fmt.Sprintf("berth takeover: --from-key %q: want a 64-bit number (0xb3e7…)", s), 2)
				}
				t.FromKey = k
			}
			if err := agent.WriteOperatorTakeover(c.String(cliflags.StateDir), t); err != nil {
				return fmt.Errorf("berth takeover: %w", err)
			}
			holder := fmt.Sprintf("key %#016x", t.FromKey)
			if t.FromNode != "" {
				holder = fmt.Sprintf("node %s (key %#016x)", t.FromNode, agent.NodeKey(t.FromNode))
			}
			fmt.Fprintf(c.App.Writer, "the next stage of volume %s on this node may preempt %s until %s\n", t.VolumeID, holder, t.Expires.UTC().Format(time.RFC3339))
			return nil
		},
	}
}
