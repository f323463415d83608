package doctor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

const release = "6.1.0-test-amd64"

// node is a fake node: file trees under one temporary root and a sysfs
// tree, tools in a bin directory, and the abstract sockets that answer.
type node struct {
	t       *testing.T
	root    string
	sys     *sysfstest.Tree
	sockets map[string]bool
}

func newNode(t *testing.T) *node {
	n := &node{t: t, root: t.TempDir(), sys: sysfstest.New(t), sockets: map[string]bool{iscsidSocket: true, multipathdSocket: true}}
	n.sys.File("module/iscsi_tcp/initstate", "live\n")
	n.sys.File("module/nvme_fabrics/initstate", "live\n")
	n.sys.File("module/nvme_tcp/initstate", "live\n")
	n.sys.File("module/dm_multipath/initstate", "live\n")
	n.sys.File("module/dm_crypt/initstate", "live\n")
	n.write("lib/modules/"+release+"/modules.dep",
		"kernel/drivers/nvme/host/nvme-tcp.ko.zst: kernel/drivers/nvme/host/nvme-fabrics.ko.zst\n"+
			"kernel/drivers/nvme/host/nvme-fabrics.ko.zst:\n"+
			"kernel/drivers/scsi/iscsi_tcp.ko: kernel/drivers/scsi/libiscsi_tcp.ko\n"+
			"kernel/drivers/md/dm-multipath.ko.xz:\n"+
			"kernel/drivers/md/dm-crypt.ko.xz:\n")
	n.write("lib/modules/"+release+"/modules.builtin", "kernel/drivers/block/loop.ko\n")
	n.write("proc/self/status", "Name:\tberth\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n")
	n.write("proc/self/mountinfo",
		"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"+
			"30 22 0:25 / "+n.path("var/lib/kubelet")+" rw,relatime shared:12 - ext4 /dev/sdb1 rw\n"+
			"31 30 0:26 / "+n.path("var/lib/kubelet/pods/x/volumes/tmp")+" rw - tmpfs tmpfs rw\n")
	n.write("proc/412/comm", "multipathd\n")
	// NVMe/TCP with TLS: nvme-tcp built with it, the .nvme keyring,
	// tlshd run through a loader (its comm is the loader's).
	n.sys.File("module/nvme_tcp/parameters/tls_handshake_timeout", "10\n")
	n.write("proc/keys", "197c817b I------     5 perm 1f1f0000     0     0 keyring   .nvme: 1\n")
	n.write("proc/98/comm", "ld-linux-x86-64\n")
	n.write("proc/98/cmdline", "/opt/lib64/ld-linux-x86-64.so.2\x00--library-path\x00/opt/lib\x00/usr/sbin/tlshd\x00")
	n.write("etc/tlshd.conf", "[debug]\nloglevel=0\n\n[authenticate]\n#keyrings=\nkeyrings= .nvme;.other\n")
	n.write("etc/iscsi/initiatorname.iscsi", "## comment\nInitiatorName=iqn.1993-08.org.debian:01:5a3b2c1d\n")
	n.write("etc/nvme/hostnqn", "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427\n")
	n.write("etc/nvme/hostid", "1b4e28ba-2fa1-11d2-883f-0016d3cca427\n")
	for _, tool := range []string{"iscsiadm", "multipathd", "mkfs.ext4", "e2fsck", "resize2fs", "mkfs.xfs", "xfs_growfs", "blkid", "cryptsetup"} {
		n.write("bin/"+tool, "#!/bin/sh\n")
		if err := os.Chmod(n.path("bin/"+tool), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(n.path("var/lib/kubelet/plugins/berth.csi.io"), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n *node) path(rel string) string { return filepath.Join(n.root, rel) }

func (n *node) write(rel, content string) {
	n.t.Helper()
	p := n.path(rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) remove(rel string) {
	n.t.Helper()
	if err := os.RemoveAll(n.path(rel)); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) config(transports ...string) Config {
	return Config{
		Transports:    transports,
		Endpoint:      "unix://" + n.path("var/lib/kubelet/plugins/berth.csi.io/csi.sock"),
		KubeletDir:    n.path("var/lib/kubelet"),
		Sys:           n.sys.Root(),
		ProcRoot:      n.path("proc"),
		EtcRoot:       n.path("etc"),
		ModulesRoot:   n.path("lib/modules"),
		DevRoot:       n.path("dev"),
		KernelRelease: release,
		Path:          []string{n.path("bin")},
		Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if network != "unix" || !n.sockets[addr] {
				return nil, fmt.Errorf("dial %s %s: connection refused", network, addr)
			}
			c1, c2 := net.Pipe()
			c2.Close()
			return c1, nil
		},
	}
}

func find(t *testing.T, r Report, name string) Check {
	t.Helper()
	for _, c := range r.Checks {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no check %q in %+v", name, r.Checks)
	return Check{}
}

func TestHealthyNode(t *testing.T) {
	n := newNode(t)
	cfg := n.config(TransportISCSI, TransportNVMeoF)
	cfg.Multipath = true
	r := Run(context.Background(), cfg)
	for _, c := range r.Checks {
		if c.Status != OK {
			t.Errorf("%s: %s: %s (fix %q)", c.Name, c.Status, c.Detail, c.Fix)
		}
	}
	if !r.Ready() || r.Err() != nil || ReadyFunc(cfg)(context.Background()) != nil {
		t.Fatalf("healthy node not ready: %v", r.Err())
	}
	for _, name := range []string{"module iscsi_tcp", "iscsid", "iscsi initiator name", "tool iscsiadm",
		"module nvme_fabrics", "module nvme_tcp", "nvme host identity", "module dm_multipath", "multipathd",
		"tool mkfs.ext4", "tool xfs_growfs", "tool blkid", "tool cryptsetup", "module dm_crypt", "endpoint directory", "mount propagation",
		"capability CAP_SYS_ADMIN", "capability CAP_SYS_RESOURCE", "capability CAP_DAC_OVERRIDE", "capability CAP_MKNOD", "capability CAP_NET_ADMIN", "capability CAP_SYS_RAWIO"} {
		find(t, r, name)
	}
	// Checks of transports not asked for are not run.
	r = Run(context.Background(), n.config(TransportNVMeoF))
	for _, c := range r.Checks {
		if strings.Contains(c.Name, "iscsi") || c.Name == "multipathd" {
			t.Errorf("check %q run for nvmeof only", c.Name)
		}
	}
}

// Each case breaks one thing on a healthy node: exactly that check must
// fail (or warn) and name a fix that mentions the given text.
func TestBrokenNode(t *testing.T) {
	for _, tc := range []struct {
		name   string
		check  string
		status Status
		fix    string // substring of Fix
		detail string // substring of Detail
		breaks func(n *node, cfg *Config)
	}{
		{"iscsid stopped", "iscsid", Fail, "systemctl enable --now iscsid", "not reachable",
			func(n *node, _ *Config) { delete(n.sockets, iscsidSocket) }},
		{"nvme_tcp loadable", "module nvme_tcp", Fail, "modprobe nvme_tcp", "not loaded (available",
			func(n *node, _ *Config) { n.sys.Remove("module/nvme_tcp") }},
		{"iscsi_tcp missing from kernel", "module iscsi_tcp", Fail, "linux-modules-extra-" + release, "not available",
			func(n *node, _ *Config) {
				n.sys.Remove("module/iscsi_tcp")
				n.write("lib/modules/"+release+"/modules.dep", "kernel/drivers/nvme/host/nvme-tcp.ko:\n")
			}},
		{"no module tree", "module nvme_tcp", Fail, "modprobe nvme_tcp", "mount the host's /lib/modules",
			func(n *node, _ *Config) { n.sys.Remove("module/nvme_tcp"); n.remove("lib/modules") }},
		{"dm_multipath builtin", "module dm_multipath", OK, "", "built into",
			func(n *node, _ *Config) {
				n.sys.Remove("module/dm_multipath")
				n.write("lib/modules/"+release+"/modules.builtin", "kernel/drivers/md/dm-multipath.ko\n")
			}},
		{"no initiator name", "iscsi initiator name", Fail, "iscsi-iname", "cannot read",
			func(n *node, _ *Config) { n.remove("etc/iscsi/initiatorname.iscsi") }},
		{"initiator name not generated", "iscsi initiator name", Fail, "systemctl restart iscsid", "GenerateName",
			func(n *node, _ *Config) { n.write("etc/iscsi/initiatorname.iscsi", "GenerateName=yes\n") }},
		{"bad initiator name", "iscsi initiator name", Fail, "iscsi-iname", "not an iqn",
			func(n *node, _ *Config) {
				n.write("etc/iscsi/initiatorname.iscsi", "InitiatorName=iqn.2024-13.Bad:x\n")
			}},
		{"initiator name iscsi rejects", "iscsi initiator name", Fail, "iscsi-iname", "not an iqn",
			func(n *node, _ *Config) {
				n.write("etc/iscsi/initiatorname.iscsi", "InitiatorName=iqn.2004-10.com.example:host@1\n")
			}},
		{"hostid differs from hostnqn uuid", "nvme host identity", Fail, "echo 1b4e28ba-2fa1-11d2-883f-0016d3cca427 > ", "two host IDs",
			func(n *node, _ *Config) { n.write("etc/nvme/hostid", "00000000-1111-2222-3333-444444444444\n") }},
		{"hostid not a uuid", "nvme host identity", Fail, "echo 1b4e28ba", "not a UUID",
			func(n *node, _ *Config) { n.write("etc/nvme/hostid", "abc\n") }},
		{"hostnqn invalid", "nvme host identity", Fail, "kernel/random/uuid", "hostnqn",
			func(n *node, _ *Config) { n.write("etc/nvme/hostnqn", "host one\n") }},
		{"no host identity", "nvme host identity", Warn, "kernel/random/uuid", "creates a random identity",
			func(n *node, _ *Config) { n.remove("etc/nvme") }},
		{"nvme-tcp without TLS", "nvme tcp tls", Warn, "CONFIG_NVME_TCP_TLS", "has no TLS",
			func(n *node, _ *Config) { n.sys.Remove("module/nvme_tcp/parameters") }},
		{"no .nvme keyring", "nvme keyring", Warn, "modprobe nvme-tcp", "no .nvme keyring",
			func(n *node, _ *Config) {
				n.write("proc/keys", "0866b008 I--Q---     2 perm 1f3f0000     0 65534 keyring   _uid.0: empty\n")
			}},
		{"tlshd not running", "tlshd", Warn, "ktls-utils", "no tlshd process",
			func(n *node, _ *Config) { n.remove("proc/98") }},
		{"tlshd.conf of the host's PID 1", "tlshd keyrings", OK, "", "/proc/1/root/etc/tlshd.conf links",
			func(n *node, _ *Config) {
				n.remove("etc/tlshd.conf")
				n.write("proc/1/root/etc/tlshd.conf", "[authenticate]\nkeyrings=.nvme\n")
			}},
		{"tlshd without .nvme", "tlshd keyrings", Warn, "keyrings=.nvme", "does not list .nvme",
			func(n *node, _ *Config) {
				n.write("etc/tlshd.conf", "[authenticate]\n#keyrings=.nvme\n[other]\nkeyrings=.nvme\n")
			}},
		{"mkfs.ext4 missing", "tool mkfs.ext4", Fail, "e2fsprogs", "not found",
			func(n *node, _ *Config) { n.remove("bin/mkfs.ext4") }},
		{"blkid not executable", "tool blkid", Fail, "util-linux", "not found",
			func(n *node, _ *Config) { os.Chmod(n.path("bin/blkid"), 0o644) }},
		{"xfs tools missing", "tool mkfs.xfs", Warn, "xfsprogs", "not found",
			func(n *node, _ *Config) { n.remove("bin/mkfs.xfs") }},
		{"cryptsetup missing", "tool cryptsetup", Warn, "cryptsetup-bin", "not found",
			func(n *node, _ *Config) { n.remove("bin/cryptsetup") }},
		{"dm_crypt loadable", "module dm_crypt", OK, "", "loads on first use",
			func(n *node, _ *Config) { n.sys.Remove("module/dm_crypt") }},
		{"dm_crypt missing from kernel", "module dm_crypt", Warn, "linux-modules-extra-" + release, "cannot stage",
			func(n *node, _ *Config) {
				n.sys.Remove("module/dm_crypt")
				n.write("lib/modules/"+release+"/modules.dep", "kernel/drivers/scsi/iscsi_tcp.ko:\nkernel/drivers/md/dm-multipath.ko.xz:\n")
			}},
		{"multipathd stopped", "multipathd", Fail, "multipathd.service", "not running",
			func(n *node, _ *Config) { delete(n.sockets, multipathdSocket); n.remove("proc/412") }},
		{"multipathd in other netns", "multipathd", Fail, "hostNetwork", "pid 412",
			func(n *node, _ *Config) { delete(n.sockets, multipathdSocket) }},
		{"kubelet dir private", "mount propagation", Fail, "mountPropagation: Bidirectional", "propagation \"private\"",
			func(n *node, _ *Config) {
				n.write("proc/self/mountinfo", "22 1 8:1 / / rw shared:1 - ext4 /dev/sda1 rw\n30 22 0:25 / "+n.path("var/lib/kubelet")+" rw - ext4 /dev/sdb1 rw\n")
			}},
		{"kubelet dir slave only", "mount propagation", Fail, "Bidirectional", "master:3",
			func(n *node, _ *Config) {
				n.write("proc/self/mountinfo", "22 1 8:1 / / rw shared:1 - ext4 /dev/sda1 rw\n30 22 0:25 / "+n.path("var/lib/kubelet")+" rw master:3 - ext4 /dev/sdb1 rw\n")
			}},
		{"no CAP_SYS_ADMIN", "capability CAP_SYS_ADMIN", Fail, "privileged: true", "no CAP_SYS_ADMIN",
			func(n *node, _ *Config) { n.write("proc/self/status", "CapEff:\t000001ffffdfffff\n") }},
		// What root gets in a sandbox that drops CAP_SYS_RESOURCE:
		// everything works but ext4 online grow.
		{"no CAP_SYS_RESOURCE", "capability CAP_SYS_RESOURCE", Warn, "SYS_RESOURCE", "ext4 volumes cannot grow online",
			func(n *node, _ *Config) { n.write("proc/self/status", "CapEff:\t000001fffeffffff\n") }},
		{"capabilities unreadable", "capabilities", Fail, "procfs", "no CapEff line",
			func(n *node, _ *Config) { n.write("proc/self/status", "Name:\tberth\n") }},
		{"no CAP_MKNOD", "capability CAP_MKNOD", Warn, "privileged: true", "loop",
			func(n *node, _ *Config) { n.write("proc/self/status", "CapEff:\t000001fff7ffffff\n") }},
		{"no CAP_NET_ADMIN", "capability CAP_NET_ADMIN", Warn, "privileged: true", "uevent",
			func(n *node, _ *Config) { n.write("proc/self/status", "CapEff:\t000001ffffffefff\n") }},
		{"no CAP_DAC_OVERRIDE", "capability CAP_DAC_OVERRIDE", Warn, "privileged: true", "fsGroup",
			func(n *node, _ *Config) { n.write("proc/self/status", "CapEff:\t000001fffffffffd\n") }},
		{"no CAP_SYS_RAWIO", "capability CAP_SYS_RAWIO", Warn, "SYS_RAWIO", "PERSISTENT RESERVE IN",
			func(n *node, _ *Config) { n.write("proc/self/status", "CapEff:\t000001fffffdffff\n") }},
		{"iscsiadm wrapper missing", "tool iscsiadm-host", Fail, "open-iscsi", "not found",
			func(n *node, cfg *Config) { cfg.Iscsiadm = n.path("bin/iscsiadm-host") }},
		{"multipathd wrapper missing", "tool multipathd-host", Fail, "multipath-tools", "not found",
			func(n *node, cfg *Config) { cfg.Multipathd = n.path("bin/multipathd-host") }},
		{"endpoint dir is a file", "endpoint directory", Fail, "remove", "not a directory",
			func(n *node, _ *Config) {
				n.remove("var/lib/kubelet/plugins/berth.csi.io")
				n.write("var/lib/kubelet/plugins/berth.csi.io", "")
			}},
		{"endpoint dir created on start", "endpoint directory", OK, "", "berth creates it",
			func(n *node, _ *Config) { n.remove("var/lib/kubelet/plugins") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			cfg := n.config(TransportISCSI, TransportNVMeoF)
			cfg.Multipath = true
			tc.breaks(n, &cfg)
			r := Run(context.Background(), cfg)
			c := find(t, r, tc.check)
			if c.Status != tc.status || !strings.Contains(c.Fix, tc.fix) || !strings.Contains(c.Detail, tc.detail) {
				t.Fatalf("%s = %s, detail %q, fix %q; want %s, detail with %q, fix with %q", tc.check, c.Status, c.Detail, c.Fix, tc.status, tc.detail, tc.fix)
			}
			for _, o := range r.Checks {
				if o.Name != tc.check && o.Status != OK {
					t.Errorf("unrelated check %s = %s: %s", o.Name, o.Status, o.Detail)
				}
			}
			if want := tc.status != Fail; r.Ready() != want {
				t.Errorf("Ready() = %v, want %v", r.Ready(), want)
			}
			if tc.status == Fail && (r.Err() == nil || !strings.Contains(r.Err().Error(), tc.check)) {
				t.Errorf("Err() = %v, want it to name %s", r.Err(), tc.check)
			}
		})
	}
}

// TestCapabilitiesMatchUnit checks that doctor checks exactly the
// capabilities the shipped berth.service grants: a capability added to
// one and not the other leaves either berth or doctor wrong about a node.
func TestCapabilitiesMatchUnit(t *testing.T) {
	unit, err := os.ReadFile(filepath.Join("..", "systemd", "berth.service"))
	if err != nil {
		t.Fatal(err)
	}
	var granted []string
	for _, l := range strings.Split(string(unit), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "CapabilityBoundingSet="); ok {
			granted = append(granted, strings.Fields(v)...)
		}
	}
	var checked []string
	for _, c := range capabilities {
		checked = append(checked, c.name)
	}
	slices.Sort(granted)
	slices.Sort(checked)
	if !slices.Equal(granted, checked) {
		t.Fatalf("berth.service's CapabilityBoundingSet is %v, doctor checks %v", granted, checked)
	}
}

func TestLoopCheck(t *testing.T) {
	n := newNode(t)
	cfg := n.config(TransportFile)
	c := find(t, Run(context.Background(), cfg), "loop devices")
	if c.Status != Fail || !strings.Contains(c.Detail, "loop-control missing") {
		t.Fatalf("loop without /dev/loop-control: %+v", c)
	}
	if fi, err := os.Stat("/dev/loop-control"); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		cfg.DevRoot = "/dev"
		if c := find(t, Run(context.Background(), cfg), "loop devices"); c.Status != OK {
			t.Fatalf("loop with the host's /dev: %+v", c)
		}
	}
}

func TestParseTransports(t *testing.T) {
	got, err := ParseTransports(" iscsi,nvmeof,iscsi,")
	if err != nil || strings.Join(got, ",") != "iscsi,nvmeof" {
		t.Fatalf("ParseTransports = %v, %v", got, err)
	}
	for _, bad := range []string{"", ",", "fc", "iscsi,rdma"} {
		if _, err := ParseTransports(bad); err == nil {
			t.Errorf("ParseTransports(%q) accepted", bad)
		}
	}
}

func TestContainingMount(t *testing.T) {
	n := newNode(t)
	n.write("proc/self/mountinfo",
		"22 1 8:1 / / rw shared:1 - ext4 /dev/sda1 rw\n"+
			"30 22 0:25 / "+n.path("var/lib/kubeletx")+" rw - ext4 /dev/sdb1 rw\n"+
			"31 22 0:26 / "+n.path("var/lib")+" rw - ext4 /dev/sdc1 rw\n"+
			"32 31 0:27 / "+n.path("var/lib")+" rw shared:7 - ext4 /dev/sdd1 rw\n")
	c := find(t, Run(context.Background(), n.config(TransportFile)), "mount propagation")
	if c.Status != OK || !strings.Contains(c.Detail, "mount "+n.path("var/lib")+" (shared:7)") {
		t.Fatalf("want the top mount on /var/lib, not /var/lib/kubeletx: %+v", c)
	}
}

func runCommand(t *testing.T, args ...string) (string, int) {
	t.Helper()
	var out bytes.Buffer
	app := &cli.App{Name: "berth", Writer: &out, ErrWriter: &out, Commands: []*cli.Command{Command()},
		ExitErrHandler: func(*cli.Context, error) {}}
	err := app.Run(append([]string{"berth", "doctor"}, args...))
	code := 0
	var ec cli.ExitCoder
	if errors.As(err, &ec) {
		code = ec.ExitCode()
	} else if err != nil {
		t.Fatalf("berth doctor %v: %v", args, err)
	}
	return out.String(), code
}

func TestCommand(t *testing.T) {
	n := newNode(t)
	// The command dials the real abstract sockets, so take iSCSI out of
	// the picture and check NVMe/TCP on the fake tree.
	args := []string{"--transports", "nvmeof", "--kubelet-dir", n.path("var/lib/kubelet"),
		"--endpoint", "unix://" + n.path("var/lib/kubelet/plugins/berth.csi.io/csi.sock"),
		"--sys-root", n.sys.Root().Path(), "--proc-root", n.path("proc"), "--etc-root", n.path("etc"),
		"--modules-root", n.path("lib/modules"), "--dev-root", n.path("dev")}
	t.Setenv("PATH", n.path("bin"))
	n.write("proc/sys/kernel/osrelease", release+"\n")

	out, code := runCommand(t, args...)
	if code != 0 || !strings.Contains(out, "node is ready for berth (nvmeof)") {
		t.Fatalf("healthy: exit %d\n%s", code, out)
	}
	for _, line := range []string{"CHECK", "module nvme_tcp", "nvme host identity"} {
		if !strings.Contains(out, line) {
			t.Errorf("table lacks %q:\n%s", line, out)
		}
	}

	n.sys.Remove("module/nvme_tcp")
	out, code = runCommand(t, args...)
	if code != 1 || !strings.Contains(out, "module nvme_tcp") || !strings.Contains(out, "FAIL") ||
		!strings.Contains(out, "To fix:\n  module nvme_tcp (fail): modprobe nvme_tcp") || !strings.Contains(out, "NOT ready") {
		t.Fatalf("nvme_tcp unloaded: exit %d\n%s", code, out)
	}

	out, code = runCommand(t, append(args, "--json")...)
	var rep struct {
		Ready  bool
		Checks []Check
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("--json output: %v\n%s", err, out)
	}
	if code != 1 || rep.Ready || len(rep.Checks) == 0 {
		t.Fatalf("--json: exit %d ready %v checks %d", code, rep.Ready, len(rep.Checks))
	}

	if _, code = runCommand(t, "--transports", "fc"); code != 2 {
		t.Fatalf("unknown transport: exit %d, want 2", code)
	}
}

func TestKubeletDirMissing(t *testing.T) {
	n := newNode(t)
	n.remove("var/lib/kubelet")
	cfg := n.config(TransportFile)
	cfg.Endpoint = ""
	c := find(t, Run(context.Background(), cfg), "mount propagation")
	if c.Status != Warn || !strings.Contains(c.Detail, "does not exist") {
		t.Fatalf("missing kubelet dir: %+v", c)
	}
}

// doctor reads the wrapper programs from the same flags and environment
// variables as berth serve, so that `berth doctor` run in berth's
// container checks the programs berth runs.
func TestCommandReadsServeEnvironment(t *testing.T) {
	n := newNode(t)
	for _, w := range []string{"bin/iscsiadm-host", "bin/multipathd-host"} {
		n.write(w, "#!/bin/sh\n")
		if err := os.Chmod(n.path(w), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("BERTH_ISCSIADM", n.path("bin/iscsiadm-host"))
	t.Setenv("BERTH_MULTIPATHD", n.path("bin/multipathd-host"))
	n.write("proc/sys/kernel/osrelease", release+"\n")
	out, _ := runCommand(t, "--transports", "iscsi", "--multipath", "--json", "--kubelet-dir", "", "--endpoint", "",
		"--sys-root", n.sys.Root().Path(), "--proc-root", n.path("proc"), "--etc-root", n.path("etc"),
		"--modules-root", n.path("lib/modules"), "--dev-root", n.path("dev"))
	var rep Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("--json output: %v\n%s", err, out)
	}
	for _, tool := range []string{"iscsiadm-host", "multipathd-host"} {
		c := find(t, rep, "tool "+tool)
		if c.Status != OK || c.Detail != n.path("bin/"+tool) {
			t.Errorf("tool %s: %+v, want OK at %s", tool, c, n.path("bin/"+tool))
		}
	}
}
