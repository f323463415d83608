package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/cliflags"
	"github.com/berth-csi/berth/iscsi"
)

func volumesCommand() *cli.Command {
	return &cli.Command{
		Name:  "volumes",
		Usage: "list the volumes this node holds: record, device, paths, mounts, usage and health",
		Description: `Reads berth's state records (--state-dir, the same flag and environment
variable as berth serve) and the kernel's view of each volume: its target,
its device and LUKS mapping, its paths (iSCSI sessions, NVMe controllers), its
staging and publish paths and whether each shows the volume, its filesystem's
size and use, and its health as NodeGetVolumeStats reports it. It says where
the records and the kernel disagree: a record whose device or mounts are gone,
a record that cannot be read, a loop device berth attached that no record
here knows (any berth's: a second berth on the node, with its own state
directory, has loop devices of its own). It changes nothing, and runs beside berth serve: the records are read
without the state directory's lock. Give it the transport flags berth serve
has (--transports, --file-root) to see each target's paths and health.`,
		Flags: []cli.Flag{
			cliflags.StateDirFlag(),
			cliflags.TransportsFlag(),
			cliflags.FileRootFlag(),
			&cli.BoolFlag{Name: "json", Usage: "print one JSON document (stateDir, consistent, volumes, unreadableRecords, unrecordedLoops)"},
		},
		Action: func(c *cli.Context) error {
			inv, err := inventory(c)
			if err != nil {
				if errors.Is(err, fs.ErrPermission) && os.Geteuid() != 0 {
					return fmt.Errorf("%w (berth's state is root's: run berth volumes as root)", err)
				}
				return err
			}
			if c.Bool("json") {
				return writeVolumesJSON(c.App.Writer, inv)
			}
			return writeVolumesTable(c.App.Writer, inv)
		},
	}
}

// inventory reads the node's volumes with the transports the flags
// enable, built as berth serve builds them but never used to attach.
func inventory(c *cli.Context) (*agent.NodeInventory, error) {
	// The file and iSCSI transports want a uevent listener; nothing
	// waits on it here.
	l, err := devices.NewListener(devices.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		return nil, fmt.Errorf("open uevent listener: %w", err)
	}
	defer l.Close()
	ts, _, err := buildTransports(transportOptions{
		list:     c.String(cliflags.Transports),
		fileRoot: c.String(cliflags.FileRoot),
		iscsi:    iscsi.Options{},
		listener: l,
		log:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return nil, err
	}
	return agent.Inventory(c.Context, agent.InventoryConfig{StateDir: c.String(cliflags.StateDir), Transports: ts})
}

func writeVolumesJSON(w io.Writer, inv *agent.NodeInventory) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Consistent bool `json:"consistent"`
		*agent.NodeInventory
	}{inv.Consistent(), inv})
}

// writeVolumesTable writes one line per volume, then each volume's
// chain (target, device, mapping, paths, mounts, usage, health, what
// disagrees), then the records that cannot be read and the loop devices
// no record knows, then a verdict.
func writeVolumesTable(w io.Writer, inv *agent.NodeInventory) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VOLUME\tTRANSPORT\tDEVICE\tFS\tSIZE\tUSED\tSTAGING\tPUBLISHED\tPATHS\tHEALTH")
	for _, v := range inv.Volumes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.VolumeID, v.Transport, deviceColumn(v), fsColumn(v),
			sizeColumn(v), usedColumn(v), stagingColumn(v), publishedColumn(v), pathsColumn(v.Paths), healthColumn(v))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, v := range inv.Volumes {
		fmt.Fprintf(w, "\n%s\n", v.VolumeID)
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		row := func(k, format string, args ...any) { fmt.Fprintf(tw, "  %s\t%s\n", k, fmt.Sprintf(format, args...)) }
		target := v.TargetKey
		if v.TargetID != "" && v.TargetID != v.TargetKey {
			target += " (" + v.TargetID + ")"
		}
		row("target", "%s", target)
		row("device", "%s", describeDevice(v.Device))
		if v.Mapping != nil {
			row("luks", "%s", describeDevice(v.Mapping))
		}
		switch {
		case len(v.Paths) > 0:
			row("paths", "%s", pathsColumn(v.Paths))
		case v.PathsError != "":
			row("paths", "unknown: %s", v.PathsError)
		}
		staging := describeMount(v.Staging, false)
		if v.AccessType == "block" {
			staging = v.Staging.Path + ": raw block, nothing mounted there"
		}
		row("staging", "%s", staging)
		for _, p := range v.Publishes {
			row("publish", "%s", describeMount(p, v.AccessType == "block"))
		}
		for _, p := range v.OtherMounts {
			row("also", "%s: the volume's device is mounted there, a path its record does not name", p)
		}
		if u := v.Usage; u != nil {
			if v.AccessType == "block" {
				row("size", "%s", sizeIEC(u.TotalBytes))
			} else {
				row("usage", "%s of %s used, %s available; %d of %d inodes", sizeIEC(u.UsedBytes), sizeIEC(u.TotalBytes), sizeIEC(u.AvailableBytes), u.UsedInodes, u.TotalInodes)
			}
		}
		row("health", "%s: %s", healthColumn(v), v.Message)
		for _, p := range v.Problems {
			row("problem", "%s", p)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if len(inv.UnreadableRecords) > 0 {
		fmt.Fprintln(w, "\nRecords that cannot be read (berth keeps them and refuses their volumes' calls):")
		for _, r := range inv.UnreadableRecords {
			fmt.Fprintf(w, "  %s: %s\n", r.Path, r.Error)
		}
	}
	if len(inv.UnrecordedLoops) > 0 {
		fmt.Fprintln(w, "\nLoop devices berth attached that no record knows:")
		for _, l := range inv.UnrecordedLoops {
			where := "not mounted"
			if len(l.Mounts) > 0 {
				where = "mounted at " + strings.Join(l.Mounts, ", ")
			}
			file := l.File
			if l.BackingFile != l.File {
				file += " (the kernel: " + l.BackingFile + ")"
			}
			fmt.Fprintf(w, "  %s (%d:%d): image %s, %s\n", l.Device, l.Major, l.Minor, file, where)
		}
	}
	var err error
	if n := problems(inv); n > 0 {
		_, err = fmt.Fprintf(w, "\n%d volume(s) in %s: the records and the kernel DISAGREE (%d problem(s))\n", len(inv.Volumes), inv.StateDir, n)
	} else {
		_, err = fmt.Fprintf(w, "\n%d volume(s) in %s: the records and the kernel agree\n", len(inv.Volumes), inv.StateDir)
	}
	return err
}

func problems(inv *agent.NodeInventory) int {
	n := len(inv.UnreadableRecords) + len(inv.UnrecordedLoops)
	for _, v := range inv.Volumes {
		n += len(v.Problems)
	}
	return n
}

func deviceColumn(v agent.InventoryVolume) string {
	d := v.Device
	if v.Mapping != nil && v.Mapping.Path != "" {
		d = v.Mapping
	}
	switch {
	case d == nil:
		return "<none>"
	case !d.Present:
		return d.Path + " (gone)"
	}
	return d.Path
}

func fsColumn(v agent.InventoryVolume) string {
	if v.AccessType == "block" {
		return "block"
	}
	return v.FsType
}

func sizeColumn(v agent.InventoryVolume) string {
	if v.Usage == nil {
		return "-"
	}
	return sizeIEC(v.Usage.TotalBytes)
}

func usedColumn(v agent.InventoryVolume) string {
	if v.Usage == nil || v.AccessType == "block" || v.Usage.TotalBytes == 0 {
		return "-"
	}
	return fmt.Sprintf("%d%%", (v.Usage.UsedBytes*100+v.Usage.TotalBytes-1)/v.Usage.TotalBytes)
}

func stagingColumn(v agent.InventoryVolume) string {
	switch {
	case v.AccessType == "block":
		return "-"
	case v.Staging.ShowsVolume:
		return "mounted"
	case v.Staging.Mounted:
		return "other"
	}
	return "missing"
}

func publishedColumn(v agent.InventoryVolume) string {
	ok := 0
	for _, p := range v.Publishes {
		if p.ShowsVolume {
			ok++
		}
	}
	return fmt.Sprintf("%d/%d", ok, len(v.Publishes))
}

func pathsColumn(states map[string]int) string {
	if len(states) == 0 {
		return "-"
	}
	var out []string
	for _, s := range slices.Sorted(maps.Keys(states)) {
		out = append(out, fmt.Sprintf("%s:%d", s, states[s]))
	}
	return strings.Join(out, ",")
}

func healthColumn(v agent.InventoryVolume) string {
	if v.Abnormal {
		return "ABNORMAL"
	}
	return "ok"
}

func describeDevice(d *agent.InventoryDevice) string {
	switch {
	case d == nil:
		return "none recorded"
	case d.Path == "":
		return d.Name + ": not recorded as open"
	}
	s := fmt.Sprintf("%s (%d:%d)", d.Path, d.Major, d.Minor)
	if d.Name != "" && !strings.HasSuffix(d.Path, "/"+d.Name) {
		s = d.Name + " " + s
	}
	if d.Kind != "" {
		s += " " + d.Kind
	}
	if d.Identity != "" {
		s += " " + d.Identity
	}
	if d.Present {
		return s + ": present"
	}
	return s + ": GONE or another device now"
}

func describeMount(m agent.InventoryMount, block bool) string {
	s := m.Path
	if m.ReadOnly {
		s += " (ro)"
	}
	switch {
	case !m.Mounted:
		return s + ": not mounted"
	case block && m.ShowsVolume:
		return s + ": a bind of the volume's device node"
	case block:
		return s + ": a bind of another device node"
	case m.ShowsVolume:
		return fmt.Sprintf("%s: %s %s, the volume's", s, m.FSType, m.Device)
	}
	return fmt.Sprintf("%s: %s %s, NOT the volume's", s, m.FSType, m.Device)
}

// sizeIEC formats n in binary units.
func sizeIEC(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
