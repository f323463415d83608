package doctor

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/keyring"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/nvmeof"
)

// Abstract unix sockets of the daemons berth talks to. Both are per
// network namespace: a containerised berth needs hostNetwork.
const (
	iscsidSocket     = "@ISCSIADM_ABSTRACT_NAMESPACE"
	multipathdSocket = "@/org/kernel/linux/storage/multipathd"
)

func kernelRelease(procRoot string) string {
	b, err := os.ReadFile(filepath.Join(procRoot, "sys", "kernel", "osrelease"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func defaultPath() []string {
	var dirs []string
	seen := map[string]bool{}
	for _, d := range append(filepath.SplitList(os.Getenv("PATH")), "/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin") {
		if d != "" && !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	return dirs
}

// modState is where a kernel module stands.
type modState int

const (
	modMissing  modState = iota // not in this kernel's module tree
	modLoadable                 // in modules.dep, not loaded
	modBuiltin                  // compiled into the kernel
	modLoaded                   // loaded module
)

// moduleName normalises a module name or a modules.dep path
// ("kernel/drivers/nvme/host/nvme-tcp.ko.zst") to the kernel's name
// ("nvme_tcp").
func moduleName(s string) string {
	s = filepath.Base(s)
	if i := strings.Index(s, ".ko"); i >= 0 {
		s = s[:i]
	}
	return strings.ReplaceAll(s, "-", "_")
}

// listsModule reports whether a modules.dep or modules.builtin file
// names module m.
func listsModule(r io.Reader, m string) (bool, error) {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 64*1024), 1024*1024)
	for s.Scan() {
		path, _, _ := strings.Cut(s.Text(), ":")
		if moduleName(strings.TrimSpace(path)) == m {
			return true, nil
		}
	}
	return false, s.Err()
}

func moduleState(cfg *Config, m string) (modState, error) {
	// initstate exists for loaded modules only; a built-in module may
	// have a /sys/module directory (for its parameters) but no initstate.
	if _, err := os.Stat(cfg.Sys.Path("module", m, "initstate")); err == nil {
		return modLoaded, nil
	}
	dir := filepath.Join(cfg.ModulesRoot, cfg.KernelRelease)
	for _, f := range []struct {
		name  string
		state modState
	}{{"modules.builtin", modBuiltin}, {"modules.dep", modLoadable}} {
		file, err := os.Open(filepath.Join(dir, f.name))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return modMissing, err
		}
		ok, err := listsModule(file, m)
		file.Close()
		if err != nil {
			return modMissing, fmt.Errorf("read %s: %w", file.Name(), err)
		}
		if ok {
			return f.state, nil
		}
	}
	if _, err := os.Stat(cfg.Sys.Path("module", m)); err == nil {
		return modBuiltin, nil
	}
	if _, err := os.Stat(filepath.Join(dir, "modules.dep")); err != nil {
		return modMissing, fmt.Errorf("no module list for kernel %s at %s (in a container, mount the host's /lib/modules read-only)", cfg.KernelRelease, dir)
	}
	return modMissing, nil
}

func checkModule(cfg *Config, m, what string) Check {
	c := Check{Name: "module " + m}
	st, err := moduleState(cfg, m)
	persist := fmt.Sprintf("modprobe %s && echo %s > /etc/modules-load.d/%s.conf", m, m, m)
	switch {
	case st == modLoaded:
		c.Status, c.Detail = OK, what+": loaded"
	case st == modBuiltin:
		c.Status, c.Detail = OK, what+": built into the kernel"
	case st == modLoadable:
		c.Status, c.Detail, c.Fix = Fail, what+": not loaded (available in kernel "+cfg.KernelRelease+")", persist
	case err != nil:
		c.Status, c.Detail, c.Fix = Fail, what+": not loaded, and "+err.Error(), persist
	default:
		c.Status, c.Detail = Fail, fmt.Sprintf("%s: not loaded and not available in kernel %s", what, cfg.KernelRelease)
		c.Fix = fmt.Sprintf("install the kernel's extra modules (e.g. linux-modules-extra-%s) or use a kernel built with %s, then %s", cfg.KernelRelease, m, persist)
	}
	return c
}

func dialCheck(ctx context.Context, cfg *Config, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	conn, err := cfg.Dial(ctx, "unix", addr)
	if err != nil {
		return err
	}
	return conn.Close()
}

func checkISCSId(ctx context.Context, cfg *Config) Check {
	c := Check{Name: "iscsid"}
	if err := dialCheck(ctx, cfg, iscsidSocket); err != nil {
		c.Status = Fail
		c.Detail = fmt.Sprintf("iscsid is not reachable on %s: %v", iscsidSocket, err)
		c.Fix = "systemctl enable --now iscsid.socket iscsid.service (package open-iscsi); in a container berth needs hostNetwork: true, the socket is per network namespace"
		return c
	}
	c.Status, c.Detail = OK, "iscsid answers on "+iscsidSocket
	return c
}

func checkInitiatorName(cfg *Config) Check {
	path := filepath.Join(cfg.EtcRoot, "iscsi", "initiatorname.iscsi")
	c := Check{Name: "iscsi initiator name"}
	fix := fmt.Sprintf("echo \"InitiatorName=$(iscsi-iname)\" > %s && systemctl restart iscsid", path)
	name, err := iscsi.ReadInitiatorName(path)
	switch {
	case errors.Is(err, fs.ErrNotExist) || (err != nil && !errors.Is(err, errdefs.ErrFailedPrecondition) && !errors.Is(err, errdefs.ErrInvalidArgument)):
		c.Status, c.Detail = Fail, err.Error()
		c.Fix = "install open-iscsi, which creates it, or " + fix
	case errors.Is(err, iscsi.ErrNameNotGenerated):
		c.Status, c.Detail = Fail, err.Error()
		c.Fix = "systemctl restart iscsid (open-iscsi writes the name on start), or " + fix
	case err != nil:
		c.Status, c.Detail, c.Fix = Fail, err.Error(), fix
	default:
		c.Status, c.Detail = OK, name
	}
	return c
}

func checkHostNQN(cfg *Config) Check {
	c := Check{Name: "nvme host identity"}
	dir := filepath.Join(cfg.EtcRoot, "nvme")
	nqnPath, idPath := filepath.Join(dir, "hostnqn"), filepath.Join(dir, "hostid")
	gen := fmt.Sprintf("u=$(cat /proc/sys/kernel/random/uuid); echo $u > %s; echo %s > %s", idPath, nvmeof.UUIDNQN("$u"), nqnPath)
	// The file nvmeof reads the node's identity from, read as it reads it.
	id, err := nvmeof.ReadHostIdentity(dir)
	var bad *nvmeof.IdentityFileError
	switch {
	case errors.As(err, &bad) && bad.Path == nqnPath:
		c.Status, c.Detail = Fail, err.Error()
		c.Fix = "write a valid NQN, e.g. " + gen + " (and register the new NQN on the targets)"
		return c
	case errors.As(err, &bad):
		c.Status, c.Detail = Fail, err.Error()
		c.Fix = fmt.Sprintf("cat /proc/sys/kernel/random/uuid > %s", idPath)
		if nqn, rerr := os.ReadFile(nqnPath); rerr == nil {
			if u, ok := nvmeof.NQNUUID(strings.TrimSpace(string(nqn))); ok {
				c.Fix = fmt.Sprintf("echo %s > %s", u, idPath)
			}
		}
		return c
	case err != nil:
		c.Status, c.Detail = Fail, err.Error()
		return c
	}
	if u, ok := nvmeof.NQNUUID(id.NQN); ok && id.ID != "" && u != id.ID {
		c.Status = Fail
		c.Detail = fmt.Sprintf("hostnqn %s carries UUID %s but hostid is %s: the kernel refuses to connect one host NQN with two host IDs", id.NQN, u, id.ID)
		c.Fix = fmt.Sprintf("echo %s > %s (keeps the NQN registered on the targets)", u, idPath)
		return c
	}
	switch {
	case id.NQN != "" && id.ID != "":
		c.Status, c.Detail = OK, fmt.Sprintf("hostnqn %s, hostid %s", id.NQN, id.ID)
	case id.NQN != "":
		c.Status, c.Detail = Warn, fmt.Sprintf("hostnqn %s, no %s: berth writes one on the first NVMe volume", id.NQN, idPath)
	case id.ID != "":
		c.Status, c.Detail = Warn, fmt.Sprintf("hostid %s, no %s: berth writes %s on the first NVMe volume", id.ID, nqnPath, nvmeof.UUIDNQN(id.ID))
	default:
		c.Status, c.Detail = Warn, fmt.Sprintf("no %s or %s: berth creates a random identity on the first NVMe volume, which targets must then allow", nqnPath, idPath)
		c.Fix = "create it now to register it on the targets in advance: " + gen
	}
	return c
}

// lookTool finds name (or a path) in cfg.Path as an executable regular file.
func lookTool(cfg *Config, name string) (string, error) {
	cands := []string{name}
	if !strings.Contains(name, "/") {
		cands = cands[:0]
		for _, d := range cfg.Path {
			if d != "" {
				cands = append(cands, filepath.Join(d, name))
			}
		}
	}
	for _, p := range cands {
		fi, err := os.Stat(p)
		if err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in %s", name, strings.Join(cfg.Path, ":"))
}

func checkTool(cfg *Config, name string, missing Status, fix string) Check {
	c := Check{Name: "tool " + filepath.Base(name)}
	p, err := lookTool(cfg, name)
	if err != nil {
		c.Status, c.Detail, c.Fix = missing, err.Error(), fix
		return c
	}
	c.Status, c.Detail = OK, p
	return c
}

func checkLoop(cfg *Config) Check {
	c := Check{Name: "loop devices"}
	p := filepath.Join(cfg.DevRoot, "loop-control")
	fi, err := os.Stat(p)
	if err == nil && fi.Mode()&fs.ModeCharDevice != 0 {
		c.Status, c.Detail = OK, p+" present"
		return c
	}
	m := checkModule(cfg, "loop", "loop devices")
	c.Status, c.Detail, c.Fix = Fail, fmt.Sprintf("%s missing; %s", p, m.Detail), m.Fix
	if m.Status == OK {
		c.Fix = "in a container, mount the host's /dev"
	}
	return c
}

// checkEncryption checks what volumes with LUKS2 encryption need: the
// cryptsetup program and the kernel's dm-crypt target. Both warn only:
// volumes without encryption stage without them. device-mapper loads
// dm_crypt itself when cryptsetup first asks for a crypt target, so a
// module that is available but not loaded passes.
func checkEncryption(cfg *Config) []Check {
	fix := "install cryptsetup (apt-get install cryptsetup-bin / dnf install cryptsetup) for volumes with encryption"
	tool := checkTool(cfg, "cryptsetup", Warn, fix)
	mod := checkModule(cfg, "dm_crypt", "device-mapper crypt target (LUKS2 volumes)")
	switch st, _ := moduleState(cfg, "dm_crypt"); {
	case st == modLoadable:
		mod.Status, mod.Detail, mod.Fix = OK, "device-mapper crypt target (LUKS2 volumes): loads on first use (available in kernel "+cfg.KernelRelease+")", ""
	case mod.Status == Fail:
		mod.Status = Warn
		mod.Detail += "; volumes with encryption cannot stage"
	}
	return []Check{tool, mod}
}

func checkMultipathd(ctx context.Context, cfg *Config) Check {
	c := Check{Name: "multipathd"}
	err := dialCheck(ctx, cfg, multipathdSocket)
	if err == nil {
		c.Status, c.Detail = OK, "multipathd answers on "+multipathdSocket
		return c
	}
	if pid := findProcess(cfg, "multipathd"); pid != 0 {
		c.Status = Fail
		c.Detail = fmt.Sprintf("multipathd runs (pid %d) but %s is not reachable: %v", pid, multipathdSocket, err)
		c.Fix = "run berth in the host's network namespace (hostNetwork: true)"
		return c
	}
	c.Status = Fail
	c.Detail = fmt.Sprintf("multipathd is not running (%s: %v)", multipathdSocket, err)
	c.Fix = "install multipath-tools and systemctl enable --now multipathd.socket multipathd.service"
	return c
}

// findProcess returns the pid of a process whose comm is name, or 0.
func findProcess(cfg *Config, name string) int {
	ents, err := os.ReadDir(cfg.ProcRoot)
	if err != nil {
		return 0
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if b, err := os.ReadFile(filepath.Join(cfg.ProcRoot, e.Name(), "comm")); err == nil && strings.TrimSpace(string(b)) == name {
			return pid
		}
	}
	return 0
}

// capability is one capability berth or the tools it runs need, with what
// fails without it. The list matches berth.service's CapabilityBoundingSet.
type capability struct {
	name    string
	bit     uint   // capability number (linux/capability.h)
	missing Status // Fail: berth cannot serve; Warn: one feature fails
	without string // what fails without it
}

var capabilities = []capability{
	{"CAP_SYS_ADMIN", 21, Fail, "berth cannot mount, set up loop devices or connect NVMe controllers"},
	{"CAP_SYS_RESOURCE", 24, Warn, "ext4 volumes cannot grow online (the kernel refuses EXT4_IOC_RESIZE_FS; NodeExpandVolume answers FAILED_PRECONDITION); xfs volumes grow without it"},
	{"CAP_DAC_OVERRIDE", 1, Warn, "berth cannot reach pod directories and volume roots owned by the pod's user after the kubelet applied fsGroup"},
	{"CAP_MKNOD", 27, Warn, "file volumes fail when devtmpfs does not show a loop device node the kernel made"},
	{"CAP_NET_ADMIN", 12, Warn, "the uevent socket keeps the net.core.rmem_max buffer; a burst of device events (many LUNs) may be dropped"},
	{"CAP_SYS_RAWIO", 17, Warn, "fenced iSCSI volumes (writer access modes without volume_context fencing: \"none\") fail to stage: the kernel refuses PERSISTENT RESERVE IN through SG_IO, with which berth reads a LUN's reservation"},
}

// effectiveCaps parses the CapEff line of /proc/<pid>/status.
func effectiveCaps(status []byte) (uint64, error) {
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return 0, fmt.Errorf("CapEff %q: %w", strings.TrimSpace(v), err)
			}
			return n, nil
		}
	}
	return 0, errors.New("no CapEff line")
}

// checkCapabilities reports each capability berth needs. doctor checks its
// own process: run it the way berth runs (same user, unit or container).
func checkCapabilities(cfg *Config) []Check {
	p := filepath.Join(cfg.ProcRoot, "self", "status")
	b, err := os.ReadFile(p)
	var eff uint64
	if err == nil {
		eff, err = effectiveCaps(b)
	}
	if err != nil {
		return []Check{{Name: "capabilities", Status: Fail, Detail: fmt.Sprintf("read capabilities from %s: %v", p, err),
			Fix: "in a container, mount the host's procfs (or the container's own) at --proc-root"}}
	}
	out := make([]Check, 0, len(capabilities))
	for _, c := range capabilities {
		ch := Check{Name: "capability " + c.name}
		switch {
		case eff&(1<<c.bit) == 0:
			ch.Status, ch.Detail = c.missing, "no "+c.name+": "+c.without
			ch.Fix = fmt.Sprintf("run berth as root with %s: berth.service's CapabilityBoundingSet has it; in Kubernetes securityContext.privileged: true; "+
				"a container runtime that drops it needs --cap-add %s", c.name, strings.TrimPrefix(c.name, "CAP_"))
		default:
			ch.Status, ch.Detail = OK, c.name
		}
		out = append(out, ch)
	}
	return out
}

// endpointPath strips the unix:// or unix: scheme of a CSI endpoint.
func endpointPath(endpoint string) string {
	if p, ok := strings.CutPrefix(endpoint, "unix://"); ok {
		return p
	}
	if p, ok := strings.CutPrefix(endpoint, "unix:"); ok {
		return p
	}
	return endpoint
}

func checkEndpointDir(cfg *Config) Check {
	dir := filepath.Dir(endpointPath(cfg.Endpoint))
	c := Check{Name: "endpoint directory"}
	probe := dir
	for {
		fi, err := os.Stat(probe)
		if err == nil {
			if !fi.IsDir() {
				c.Status, c.Detail, c.Fix = Fail, probe+" is not a directory", "remove "+probe+" or choose another --endpoint"
				return c
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || probe == filepath.Dir(probe) {
			c.Status, c.Detail = Fail, err.Error()
			return c
		}
		probe = filepath.Dir(probe)
	}
	f, err := os.CreateTemp(probe, ".berth-doctor-")
	if err != nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("cannot create files in %s: %v", probe, err)
		c.Fix = "make " + probe + " writable for berth (in a container, mount the host directory read-write)"
		return c
	}
	f.Close()
	os.Remove(f.Name())
	if probe != dir {
		c.Status, c.Detail = OK, fmt.Sprintf("%s does not exist yet; berth creates it under writable %s", dir, probe)
		return c
	}
	c.Status, c.Detail = OK, dir+" is writable"
	return c
}

// containingMount returns the mount whose mount point is the longest
// prefix of path, from mountinfo entries.
func containingMount(mounts []*mountinfo.Info, path string) *mountinfo.Info {
	var best *mountinfo.Info
	for _, m := range mounts {
		mp := m.Mountpoint
		if path == mp || mp == "/" || strings.HasPrefix(path, strings.TrimSuffix(mp, "/")+"/") {
			// Later entries with the same mount point are stacked on
			// top and win.
			if best == nil || len(mp) >= len(best.Mountpoint) {
				best = m
			}
		}
	}
	return best
}

func checkPropagation(cfg *Config) Check {
	c := Check{Name: "mount propagation"}
	dir := filepath.Clean(cfg.KubeletDir)
	p := filepath.Join(cfg.ProcRoot, "self", "mountinfo")
	f, err := os.Open(p)
	if err != nil {
		c.Status, c.Detail = Fail, err.Error()
		return c
	}
	defer f.Close()
	mounts, err := mountinfo.GetMountsFromReader(f, nil)
	if err != nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("parse %s: %v", p, err)
		return c
	}
	m := containingMount(mounts, dir)
	if m == nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("no mount contains %s in %s", dir, p)
		return c
	}
	shared := false
	for _, o := range strings.Fields(m.Optional) {
		if strings.HasPrefix(o, "shared:") {
			shared = true
		}
	}
	opt := m.Optional
	if opt == "" {
		opt = "private"
	}
	if !shared {
		c.Status = Fail
		c.Detail = fmt.Sprintf("%s is on mount %s with propagation %q: berth's mounts would not reach the kubelet and pods", dir, m.Mountpoint, opt)
		c.Fix = fmt.Sprintf("in Kubernetes mount %s with mountPropagation: Bidirectional; on a host run `mount --make-rshared %s` and find what made it private", dir, m.Mountpoint)
		return c
	}
	c.Status, c.Detail = OK, fmt.Sprintf("%s is on mount %s (%s)", dir, m.Mountpoint, opt)
	if _, err := os.Stat(dir); err != nil {
		c.Status = Warn
		c.Detail += "; but " + dir + " does not exist: is the kubelet's --root-dir elsewhere?"
	}
	return c
}

// checkTLS checks what NVMe/TCP with TLS (volume_context tls "true")
// needs: the kernel's TLS support in nvme-tcp, the .nvme keyring, and
// tlshd, the handshake daemon, running on the host with .nvme in its
// keyrings. A node without them serves every other volume, so each is a
// warning.
func checkTLS(cfg *Config) []Check {
	kernel := Check{Name: "nvme tcp tls"}
	// nvme-tcp has the parameter exactly when it is built with
	// CONFIG_NVME_TCP_TLS (measured on Debian 13's 6.12).
	param := cfg.Sys.Path("module", "nvme_tcp", "parameters", "tls_handshake_timeout")
	switch _, err := os.Stat(param); {
	case err == nil:
		kernel.Status, kernel.Detail = OK, "nvme-tcp has TLS (tls_handshake_timeout)"
	case errors.Is(err, fs.ErrNotExist):
		if _, err := os.Stat(cfg.Sys.Path("module", "nvme_tcp")); err != nil {
			// Not loaded: the module check says so, and whether it
			// has TLS shows once it is.
			kernel.Status, kernel.Detail = OK, "nvme-tcp is not loaded: whether it has TLS shows once it is"
			break
		}
		kernel.Status, kernel.Detail = Warn, "nvme-tcp has no TLS (CONFIG_NVME_TCP_TLS is not set): volumes with tls \"true\" cannot stage"
		kernel.Fix = "use a kernel built with CONFIG_NVME_TCP_TLS (Linux 6.7 or later, e.g. Debian 13's)"
	default:
		kernel.Status, kernel.Detail = Warn, err.Error()
	}

	ring := Check{Name: "nvme keyring"}
	f, err := os.Open(filepath.Join(cfg.ProcRoot, "keys"))
	var keys []keyring.Key
	if err == nil {
		keys, err = keyring.ParseProcKeys(f)
		f.Close()
	}
	found := false
	for _, k := range keys {
		found = found || k.Type == "keyring" && k.Description == ".nvme"
	}
	switch {
	case err != nil:
		ring.Status, ring.Detail = Warn, fmt.Sprintf("cannot list the kernel's keys: %v", err)
	case found:
		ring.Status, ring.Detail = OK, "the kernel's .nvme keyring holds the TLS PSKs"
	default:
		ring.Status, ring.Detail = Warn, "no .nvme keyring (nvme-tcp creates it when loaded, with CONFIG_NVME_KEYRING): volumes with tls \"true\" cannot stage"
		ring.Fix = "modprobe nvme-tcp"
	}

	daemon := Check{Name: "tlshd"}
	if running := processRunning(cfg, "tlshd"); running {
		daemon.Status, daemon.Detail = OK, "tlshd runs (the kernel's TLS handshakes)"
	} else {
		daemon.Status, daemon.Detail = Warn, "no tlshd process seen: volumes with tls \"true\" fail to connect (in a container berth sees the host's processes only with hostPID)"
		daemon.Fix = "apt-get install ktls-utils && systemctl enable --now tlshd (on the host, as iscsid)"
	}

	conf := Check{Name: "tlshd keyrings"}
	confPath := filepath.Join(cfg.EtcRoot, "tlshd.conf")
	b, err := os.ReadFile(confPath)
	if errors.Is(err, fs.ErrNotExist) {
		// In berth's container (hostPID) the host's /etc is that of
		// its PID 1.
		host := filepath.Join(cfg.ProcRoot, "1", "root", "etc", "tlshd.conf")
		if hb, herr := os.ReadFile(host); herr == nil {
			confPath, b, err = host, hb, nil
		}
	}
	switch {
	case err != nil:
		conf.Status, conf.Detail = Warn, fmt.Sprintf("%s: %v", confPath, unwrapPathErr(err))
		conf.Fix = "install ktls-utils and set keyrings=.nvme under [authenticate] in /etc/tlshd.conf"
	case tlshdKeyrings(string(b))[".nvme"]:
		conf.Status, conf.Detail = OK, confPath+" links the .nvme keyring"
	default:
		conf.Status, conf.Detail = Warn, confPath+" does not list .nvme in [authenticate] keyrings: tlshd may not read the PSKs berth inserts there"
		conf.Fix = "set keyrings=.nvme under [authenticate] in /etc/tlshd.conf and restart tlshd"
	}
	return []Check{kernel, ring, daemon, conf}
}

// tlshdKeyrings returns the keyrings of the [authenticate] section of a
// tlshd.conf ("keyrings= .nvme;.other").
func tlshdKeyrings(conf string) map[string]bool {
	out := map[string]bool{}
	section := ""
	for _, line := range strings.Split(conf, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		if strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]") {
			section = line[1 : len(line)-1]
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || section != "authenticate" || strings.TrimSpace(k) != "keyrings" {
			continue
		}
		for _, r := range strings.Split(v, ";") {
			if r = strings.TrimSpace(r); r != "" {
				out[r] = true
			}
		}
	}
	return out
}

// processRunning reports whether a process whose command name, or the
// program its command line runs, is name runs in cfg.ProcRoot.
func processRunning(cfg *Config, name string) bool {
	dirs, _ := filepath.Glob(filepath.Join(cfg.ProcRoot, "[0-9]*"))
	for _, d := range dirs {
		if b, err := os.ReadFile(filepath.Join(d, "comm")); err == nil && strings.TrimSpace(string(b)) == name {
			return true
		}
		if b, err := os.ReadFile(filepath.Join(d, "cmdline")); err == nil {
			for _, arg := range strings.Split(string(b), "\x00") {
				if filepath.Base(arg) == name {
					return true
				}
			}
		}
	}
	return false
}

// unwrapPathErr drops the path of a *fs.PathError.
func unwrapPathErr(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
