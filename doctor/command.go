package doctor

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/internal/cliflags"
	"github.com/berth-csi/berth/internal/sysfs"
)

// DefaultEndpoint is the endpoint `berth doctor` checks unless told.
const DefaultEndpoint = "unix:///var/lib/kubelet/plugins/berth.csi.io/csi.sock"

// Command returns the `berth doctor` command. It exits 1 when a check
// failed, so it can gate a node's readiness in scripts and init containers.
func Command() *cli.Command {
	return &cli.Command{
		Name:  "doctor",
		Usage: "check that this node has what berth needs, and say how to fix what it lacks",
		Description: `Checks berth's capabilities, kernel modules, iscsid, multipathd, the iSCSI
initiator name, the NVMe host identity, the filesystem tools and the
iscsiadm/multipathd programs berth runs (--iscsiadm, --multipathd: the same
flags and environment variables as berth serve), the endpoint directory and
the mount propagation of the kubelet directory. Exits 1 when the node is not
ready.`,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "transports", Value: "iscsi,nvmeof", Usage: "transports this node must serve: comma-separated iscsi, nvmeof, file"},
			&cli.BoolFlag{Name: "multipath", Usage: "volumes use dm-multipath: require dm_multipath and multipathd"},
			&cli.StringFlag{Name: "endpoint", Value: DefaultEndpoint, EnvVars: []string{"BERTH_ENDPOINT", "CSI_ENDPOINT"}, Usage: "CSI endpoint whose directory must be writable (empty: skip)"},
			cliflags.KubeletDirFlag("kubelet root directory that needs shared mount propagation (empty: skip)"),
			// The programs berth runs: the same flags and environment
			// variables as berth serve.
			cliflags.IscsiadmFlag(),
			cliflags.MultipathdFlag(),
			&cli.BoolFlag{Name: "json", Usage: "print the report as JSON"},
			&cli.StringFlag{Name: "sys-root", Value: "/sys", Usage: "where the node's sysfs is mounted"},
			&cli.StringFlag{Name: "proc-root", Value: "/proc", Usage: "where procfs is mounted"},
			&cli.StringFlag{Name: "etc-root", Value: "/etc", Usage: "the node's /etc (iscsi/, nvme/)"},
			&cli.StringFlag{Name: "modules-root", Value: "/lib/modules", Usage: "the node's kernel module tree"},
			&cli.StringFlag{Name: "dev-root", Value: "/dev", Usage: "the node's /dev"},
		},
		Action: func(c *cli.Context) error {
			transports, err := ParseTransports(c.String("transports"))
			if err != nil {
				return cli.Exit(err.Error(), 2)
			}
			r := Run(c.Context, Config{
				Transports:  transports,
				Multipath:   c.Bool("multipath"),
				Endpoint:    c.String("endpoint"),
				KubeletDir:  c.String(cliflags.KubeletDir),
				Iscsiadm:    c.String(cliflags.Iscsiadm),
				Multipathd:  c.String(cliflags.Multipathd),
				Sys:         sysfs.At(c.String("sys-root")),
				ProcRoot:    c.String("proc-root"),
				EtcRoot:     c.String("etc-root"),
				ModulesRoot: c.String("modules-root"),
				DevRoot:     c.String("dev-root"),
			})
			out := c.App.Writer
			if c.Bool("json") {
				err = r.WriteJSON(out)
			} else {
				err = r.WriteTable(out)
			}
			if err != nil {
				return fmt.Errorf("write report: %w", err)
			}
			if !r.Ready() {
				return cli.Exit("", 1)
			}
			return nil
		},
	}
}
