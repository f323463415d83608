package main

import (
	"fmt"
	"os"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/metrics"
)

func trimCommand() *cli.Command {
	return &cli.Command{
		Name:      "trim",
		Usage:     "discard the unused blocks of staged volumes' filesystems (fstrim), so that thin storage can reuse them",
		UsageText: "berth trim [--state-dir DIR] (--volume-id ID ... | --all)",
		Description: `Trims the filesystem of each volume named (or of every volume this node has
staged) at its staging path, with the FITRIM ioctl, after checking that the
staging path is the root of a mount of the volume's recorded device. It reads
the volume records of berth's state directory and runs beside berth serve.

Prints one line per volume: its ID and the bytes the filesystem reports
trimmed, or why it was skipped: a raw block volume (berth has no
filesystem on it), a read-only one (reader-only access mode or ro mount
flag), a volume whose stage did not complete, or one whose trim (another
berth trim, or serve's --trim-interval) is in progress. Exits 1 when a trim
failed or a volume is not staged here.

An encrypted volume is trimmed down to the storage only when its dm-crypt
mapping allows discards (volume_context encryptionAllowDiscards: "true").`,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "state-dir", Value: "/var/lib/berth", EnvVars: []string{"BERTH_STATE_DIR"}, Usage: "berth serve's state directory"},
			&cli.StringSliceFlag{Name: "volume-id", Usage: "volume to trim (repeatable)"},
			&cli.BoolFlag{Name: "all", Usage: "trim every volume staged on this node"},
		},
		Action: trim,
	}
}

func trim(c *cli.Context) error {
	ids, all := c.StringSlice("volume-id"), c.Bool("all")
	switch {
	case c.NArg() > 0:
		return cli.Exit(fmt.Sprintf("berth trim: unexpected argument %q (name volumes with --volume-id)", c.Args().First()), 2)
	case all && len(ids) > 0:
		return cli.Exit("berth trim: give --volume-id or --all, not both", 2)
	case !all && len(ids) == 0:
		return cli.Exit("berth trim: give --volume-id ID or --all", 2)
	}
	if euid := os.Geteuid(); euid != 0 {
		return fmt.Errorf("berth trim must run as root (FITRIM needs CAP_SYS_ADMIN); running as uid %d", euid)
	}
	results, err := agent.TrimVolumes(c.Context, c.String("state-dir"), ids)
	if err != nil {
		return err
	}
	failed := 0
	for _, r := range results {
		id := r.VolumeID
		if id == "" {
			id = "?"
		}
		switch {
		case r.Err != nil:
			failed++
			fmt.Fprintf(c.App.Writer, "%s\tfailed: %v\n", id, r.Err)
		case r.Skipped != "":
			fmt.Fprintf(c.App.Writer, "%s\tskipped: %s\n", id, r.Skipped)
		default:
			fmt.Fprintf(c.App.Writer, "%s\ttrimmed %d bytes\n", id, r.Trimmed)
		}
	}
	if failed > 0 {
		return cli.Exit(fmt.Sprintf("berth trim: %d of %d volumes failed", failed, len(results)), 1)
	}
	if all && len(results) == 0 {
		fmt.Fprintln(c.App.Writer, "no volume is staged on this node")
	}
	return nil
}

// trimMetricResult is the result label of a periodic trim's result.
func trimMetricResult(r agent.TrimResult) string {
	switch {
	case r.Err != nil:
		return metrics.TrimFailed
	case r.Skipped != "":
		return metrics.TrimSkipped
	}
	return metrics.TrimTrimmed
}
