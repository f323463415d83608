// Package cliflags defines the command-line flags that more than one berth
// command reads. `berth serve` and `berth doctor` take them from here, so
// that both agree on names, environment variables and defaults, and
// `berth doctor` run where berth runs (its container, its unit's
// environment) checks the programs berth will run.
package cliflags

import "github.com/urfave/cli/v2"

// Names of the shared flags, for cli.Context lookups.
const (
	Iscsiadm   = "iscsiadm"
	Multipathd = "multipathd"
	KubeletDir = "kubelet-dir"
)

// DefaultKubeletDir is the kubelet's root directory (its --root-dir)
// unless a distribution moves it (k0s, microk8s and others do).
const DefaultKubeletDir = "/var/lib/kubelet"

// IscsiadmFlag is the iscsiadm program berth runs.
func IscsiadmFlag() *cli.StringFlag {
	return &cli.StringFlag{Name: Iscsiadm, Value: "iscsiadm", EnvVars: []string{"BERTH_ISCSIADM"},
		Usage: "iscsiadm executable, or a wrapper that runs the host's iscsiadm (containers)"}
}

// MultipathdFlag is the multipathd program berth runs.
func MultipathdFlag() *cli.StringFlag {
	return &cli.StringFlag{Name: Multipathd, Value: "multipathd", EnvVars: []string{"BERTH_MULTIPATHD"},
		Usage: "multipathd executable, or a wrapper that runs the host's multipathd (containers)"}
}

// KubeletDirFlag is the kubelet's root directory: berth serve registers
// under its plugins_registry, berth doctor checks its mount propagation.
func KubeletDirFlag(usage string) *cli.StringFlag {
	return &cli.StringFlag{Name: KubeletDir, Value: DefaultKubeletDir, EnvVars: []string{"BERTH_KUBELET_DIR"}, Usage: usage}
}
