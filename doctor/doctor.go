// Package doctor checks whether a node has what berth needs: its
// capabilities, kernel modules, iscsid, multipathd, host identities, filesystem tools, a
// writable endpoint directory and shared mount propagation for the
// kubelet's directory. Each failed check names a concrete fix.
//
// The same checks back `berth doctor` and, through Report.Ready, the
// agent's Probe. All file system locations come from Config, so the checks
// run against saved trees in tests.
package doctor

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/berth-csi/berth/internal/sysfs"
)

// Transport names, as in volume_context "transport".
const (
	TransportISCSI  = "iscsi"
	TransportNVMeoF = "nvmeof"
	TransportFile   = "file"
)

// Status of one check.
type Status string

const (
	OK   Status = "ok"
	Warn Status = "warn" // works, but not as it should on a production node
	Fail Status = "fail" // berth cannot serve the requested transports
)

// Check is the outcome of one check.
type Check struct {
	Name   string `json:"name"`
	Status Status `json:"status"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

// Report is the outcome of Run.
type Report struct {
	Transports []string `json:"transports"`
	Checks     []Check  `json:"checks"`
}

// Ready reports whether no check failed.
func (r Report) Ready() bool {
	for _, c := range r.Checks {
		if c.Status == Fail {
			return false
		}
	}
	return true
}

// Failed returns the checks that failed.
func (r Report) Failed() []Check {
	var f []Check
	for _, c := range r.Checks {
		if c.Status == Fail {
			f = append(f, c)
		}
	}
	return f
}

// Err returns nil when the node is ready, else an error naming each
// failed check and its fix; for a Probe that explains itself.
func (r Report) Err() error {
	f := r.Failed()
	if len(f) == 0 {
		return nil
	}
	msgs := make([]string, len(f))
	for i, c := range f {
		msgs[i] = c.Name + ": " + c.Detail
		if c.Fix != "" {
			msgs[i] += " (fix: " + c.Fix + ")"
		}
	}
	return fmt.Errorf("node not ready for berth: %s", strings.Join(msgs, "; "))
}

// Config says what to check and where the node's files are.
type Config struct {
	// Transports wanted on this node: iscsi, nvmeof, file. Checks for
	// other transports are not run.
	Transports []string
	// Multipath: volumes use dm-multipath (iSCSI with several portals),
	// so dm_multipath and multipathd are required.
	Multipath bool
	// Endpoint is the CSI socket ("unix:///..." or a path); its directory
	// must exist and be writable. Empty skips the check.
	Endpoint string
	// KubeletDir must sit on a mount with shared propagation so that
	// berth's mounts reach the kubelet and pods. Empty skips the check.
	KubeletDir string
	// Iscsiadm and Multipathd are the programs berth runs (names looked
	// up in Path, or paths): the tools or the wrappers that run the
	// host's tools from a container.
	Iscsiadm, Multipathd string

	// Sys is the node's sysfs tree; the zero value is /sys.
	Sys sysfs.Root
	// Roots of the node's other file systems; defaults /proc, /etc,
	// /lib/modules, /dev.
	ProcRoot, EtcRoot, ModulesRoot, DevRoot string
	// KernelRelease selects ModulesRoot/<release>; default uname -r.
	KernelRelease string
	// Path lists the directories searched for tools; default $PATH and
	// the sbin directories.
	Path []string
	// Dial connects to a unix socket ("@name" is abstract); default net.Dialer.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// Timeout bounds each socket check; default 2s.
	Timeout time.Duration
}

func (c *Config) setDefaults() {
	def := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	def(&c.ProcRoot, "/proc")
	def(&c.EtcRoot, "/etc")
	def(&c.ModulesRoot, "/lib/modules")
	def(&c.DevRoot, "/dev")
	def(&c.Iscsiadm, "iscsiadm")
	def(&c.Multipathd, "multipathd")
	if c.KernelRelease == "" {
		c.KernelRelease = kernelRelease(c.ProcRoot)
	}
	if c.Path == nil {
		c.Path = defaultPath()
	}
	if c.Dial == nil {
		var d net.Dialer
		c.Dial = d.DialContext
	}
	if c.Timeout == 0 {
		c.Timeout = 2 * time.Second
	}
}

func (c *Config) wants(transport string) bool {
	for _, t := range c.Transports {
		if t == transport {
			return true
		}
	}
	return false
}

// ParseTransports splits a comma-separated list and rejects unknown names.
func ParseTransports(s string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		switch f {
		case "":
			continue
		case TransportISCSI, TransportNVMeoF, TransportFile:
		default:
			return nil, fmt.Errorf("transport %q: want iscsi, nvmeof or file", f)
		}
		if !seen[f] {
			seen[f] = true
			out = append(out, f)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no transport in %q: want a comma-separated list of iscsi, nvmeof, file", s)
	}
	return out, nil
}

// Run checks the node. It never fails as a whole: a check that cannot
// read what it needs reports that as its own failure.
func Run(ctx context.Context, cfg Config) Report {
	cfg.setDefaults()
	r := Report{Transports: cfg.Transports}
	add := func(c ...Check) { r.Checks = append(r.Checks, c...) }

	add(checkCapabilities(&cfg)...)
	if cfg.wants(TransportISCSI) {
		add(checkModule(&cfg, "iscsi_tcp", "iSCSI over TCP"))
		add(checkISCSId(ctx, &cfg))
		add(checkInitiatorName(&cfg))
		add(checkTool(&cfg, cfg.Iscsiadm, Fail, "install open-iscsi (apt-get install open-iscsi / dnf install iscsi-initiator-utils), or in a container install the iscsiadm wrapper berth is given"))
	}
	if cfg.wants(TransportNVMeoF) {
		add(checkModule(&cfg, "nvme_fabrics", "NVMe over Fabrics core, /dev/nvme-fabrics"))
		add(checkModule(&cfg, "nvme_tcp", "NVMe/TCP"))
		add(checkHostNQN(&cfg))
		add(checkTLS(&cfg)...)
	}
	if cfg.wants(TransportFile) {
		add(checkLoop(&cfg))
	}
	if cfg.Multipath {
		add(checkModule(&cfg, "dm_multipath", "device-mapper multipath"))
		add(checkMultipathd(ctx, &cfg))
		add(checkTool(&cfg, cfg.Multipathd, Fail, "install multipath-tools (apt-get install multipath-tools / dnf install device-mapper-multipath), or in a container install the multipathd wrapper berth is given"))
	}
	e2fs := "install e2fsprogs (apt-get install e2fsprogs)"
	xfs := "install xfsprogs (apt-get install xfsprogs) for fsType xfs"
	add(checkTool(&cfg, "mkfs.ext4", Fail, e2fs),
		checkTool(&cfg, "e2fsck", Fail, e2fs),
		checkTool(&cfg, "resize2fs", Fail, e2fs),
		checkTool(&cfg, "mkfs.xfs", Warn, xfs),
		checkTool(&cfg, "xfs_growfs", Warn, xfs),
		checkTool(&cfg, "blkid", Fail, "install util-linux (apt-get install util-linux)"))
	add(checkEncryption(&cfg)...)
	if cfg.Endpoint != "" {
		add(checkEndpointDir(&cfg))
	}
	if cfg.KubeletDir != "" {
		add(checkPropagation(&cfg))
	}
	return r
}

// ReadyFunc returns a readiness check for the agent's Probe: it runs the
// checks of cfg and returns Report.Err, nil when the node is ready.
func ReadyFunc(cfg Config) func(context.Context) error {
	return func(ctx context.Context) error { return Run(ctx, cfg).Err() }
}
