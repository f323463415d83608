// Package cliflags defines the command-line flags that more than one berth
// command reads. `berth serve`, `berth doctor` and `berth volumes` take
// them from here, so that they agree on names, environment variables and
// defaults: `berth doctor` run where berth runs (its container, its
// unit's environment) checks the programs berth will run, and `berth
// volumes` reads the state and the transports berth serves.
package cliflags

import "github.com/urfave/cli/v2"

// Names of the shared flags, for cli.Context lookups.
const (
	Iscsiadm   = "iscsiadm"
	Multipathd = "multipathd"
	KubeletDir = "kubelet-dir"
	StateDir   = "state-dir"
	Transports = "transports"
	FileRoot   = "file-root"
)

// DefaultStateDir is where berth keeps its per-volume state unless told.
const DefaultStateDir = "/var/lib/berth"

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

// StateDirFlag is berth's state directory.
func StateDirFlag() *cli.StringFlag {
	return &cli.StringFlag{Name: StateDir, Value: DefaultStateDir, EnvVars: []string{"BERTH_STATE_DIR"}, Usage: "directory of the per-volume state"}
}

// TransportsFlag is the list of the network transports berth serves.
func TransportsFlag() *cli.StringFlag {
	return &cli.StringFlag{Name: Transports, Value: "nvmeof,iscsi", EnvVars: []string{"BERTH_TRANSPORTS"}, Usage: "transports to serve: comma-separated nvmeof, iscsi, file (empty: none); --file-root enables file whether listed or not"}
}

// FileRootFlag is the file transport's directory of images.
func FileRootFlag() *cli.StringFlag {
	return &cli.StringFlag{Name: FileRoot, EnvVars: []string{"BERTH_FILE_ROOT"}, Usage: "directory of image files for the file transport (empty: transport disabled)"}
}
