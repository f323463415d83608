package vm

import (
	"fmt"
	"os"
	"regexp"
	"time"
)

// An Option configures a guest.
type Option func(*config)

type config struct {
	name       string
	pkgDir     string
	run        string
	testArgs   []string
	modules    []string
	timeout    time.Duration
	memoryMB   int
	cpus       int
	udev       bool
	iscsid     bool
	multipathd bool
	systemd    bool
	files      map[string]string
	berthTags  string
	kernel     string
	kernelArgs []string
	env        map[string]string
	nics       []nic
	// hangFirstBoot makes the first boot's init stop before the tests
	// (a self-test of the boot watchdog).
	hangFirstBoot bool
	// fakeOopsFirstBoot makes the first boot's kernel log print a known
	// kernel bug's oops (a self-test of the retry on it).
	fakeOopsFirstBoot bool
	// rerunOnKernelBug boots the guest once more when its kernel oopses in
	// one of knownKernelBugs (RunGuestTests: a guest that runs its tests
	// alone, with no host protocol to resume).
	rerunOnKernelBug bool
}

type nic struct {
	link *Link
	addr string // CIDR
}

func defaultConfig() *config {
	return &config{
		kernel:   os.Getenv("BERTH_VM_KERNEL_SUITE"),
		timeout:  4 * time.Minute,
		memoryMB: 1024,
		cpus:     2,
		files:    map[string]string{},
		env:      map[string]string{},
	}
}

// WithName names the guest in logs (default: the test name).
func WithName(name string) Option { return func(c *config) { c.name = name } }

// WithPackage builds the in-guest test binary from the package in dir (a
// directory path, relative to the calling test's package) instead of the
// calling package.
func WithPackage(dir string) Option { return func(c *config) { c.pkgDir = dir } }

// WithTestRun selects the in-guest tests (the -test.run pattern). Without it
// every test of the binary runs in the guest, where TestVM* entries skip.
func WithTestRun(pattern string) Option {
	regexp.MustCompile(pattern)
	return func(c *config) { c.run = pattern }
}

// WithTestArgs adds arguments to the in-guest test binary (e.g. "-test.count=2").
func WithTestArgs(args ...string) Option {
	return func(c *config) { c.testArgs = append(c.testArgs, args...) }
}

// WithModules loads kernel modules (with their dependencies) before the tests.
func WithModules(names ...string) Option {
	return func(c *config) { c.modules = append(c.modules, names...) }
}

// WithTimeout bounds the whole guest run, boot included (default 4 minutes).
// The in-guest test binary gets a -test.timeout slightly shorter.
func WithTimeout(d time.Duration) Option { return func(c *config) { c.timeout = d } }

// WithMemory sets the guest memory in MiB (default 1024). The initramfs and
// the tmpfs-backed test volumes live in it.
func WithMemory(mb int) Option { return func(c *config) { c.memoryMB = mb } }

// WithCPUs sets the number of guest CPUs (default 2).
func WithCPUs(n int) Option { return func(c *config) { c.cpus = n } }

// WithUdev starts systemd-udevd and waits for trigger and settle before the
// tests, so /dev/disk/by-* links exist and udev events carry ID_* properties.
func WithUdev() Option { return func(c *config) { c.udev = true } }

// WithIscsid starts the open-iscsi daemon (iscsid) before the tests.
func WithIscsid() Option { return func(c *config) { c.iscsid = true } }

// WithMultipathd starts multipathd (it implies WithUdev and loads dm_multipath).
func WithMultipathd() Option {
	return func(c *config) {
		c.multipathd = true
		c.udev = true
	}
}

// WithSystemd boots the Debian root from a disk image (a throwaway snapshot)
// with systemd as PID 1; the tests run from a service unit once the system
// reached multi-user.target. systemd-udevd runs; WithIscsid and
// WithMultipathd start iscsid.service and multipathd.service. Slower to boot
// than the default initramfs guest.
func WithSystemd() Option { return func(c *config) { c.systemd = true } }

// WithExtraFiles copies host files (or directories) into the guest:
// hostPath -> absolute guest path.
func WithExtraFiles(files map[string]string) Option {
	return func(c *config) {
		for h, g := range files {
			c.files[h] = g
		}
	}
}

// WithBerthTags builds the guest's /usr/bin/berth with these build tags
// (comma-separated), e.g. "failpoints".
func WithBerthTags(tags string) Option { return func(c *config) { c.berthTags = tags } }

// WithKernel boots the cloud kernel of another Debian suite (e.g.
// "trixie": Debian 13's 6.12, built with NVMe in-band authentication;
// "trixie-backports": the newest of Debian 13's backports, 7.3, whose
// nvmet has NVMe reservations) instead of the default image's (the host
// suite's: Debian 12's 6.1). The
// Debian root and tools are the same; test/vm/image/build.sh SUITE builds
// and caches that image. BERTH_VM_KERNEL_SUITE=SUITE in the environment
// gives every guest without WithKernel that suite's kernel (to run a
// package's guest tests once on another kernel).
func WithKernel(suite string) Option { return func(c *config) { c.kernel = suite } }

// WithKernelArgs adds parameters to the guest kernel's command line (e.g.
// "nvme_core.multipath=N" for one block device per NVMe controller).
func WithKernelArgs(args ...string) Option {
	return func(c *config) { c.kernelArgs = append(c.kernelArgs, args...) }
}

// WithEnv sets environment variables of the in-guest test binary.
func WithEnv(kv map[string]string) Option {
	return func(c *config) {
		for k, v := range kv {
			c.env[k] = v
		}
	}
}

// WithNIC attaches the guest to link with a static address in CIDR form
// ("192.168.77.1/24"). The first NIC is eth0 in the guest, the next eth1...
func WithNIC(link *Link, cidr string) Option {
	return func(c *config) { c.nics = append(c.nics, nic{link: link, addr: cidr}) }
}

func (c *config) validate() error {
	if c.timeout < 20*time.Second {
		return fmt.Errorf("vm: timeout %v is too short to boot a guest", c.timeout)
	}
	if c.memoryMB < 256 {
		return fmt.Errorf("vm: %d MiB of memory is too little", c.memoryMB)
	}
	if !regexp.MustCompile(`^([a-z]+(-backports)?)?$`).MatchString(c.kernel) {
		return fmt.Errorf("vm: kernel suite %q: want a Debian suite name such as trixie or trixie-backports", c.kernel)
	}
	for _, a := range c.kernelArgs {
		if !regexp.MustCompile(`^[A-Za-z0-9_.-]+(=[A-Za-z0-9_.,:-]*)?$`).MatchString(a) {
			return fmt.Errorf("vm: kernel parameter %q: want name or name=value", a)
		}
	}
	for _, n := range c.nics {
		if !regexp.MustCompile(`^[0-9.]+/[0-9]+$`).MatchString(n.addr) {
			return fmt.Errorf("vm: NIC address %q: want IPv4 CIDR", n.addr)
		}
	}
	return nil
}

// withHangFirstBoot makes the guest's first boot hang in init, as a guest
// stuck in early boot would: the harness's own test of its boot watchdog.
func withHangFirstBoot() Option { return func(c *config) { c.hangFirstBoot = true } }

// withFakeOopsFirstBoot makes the guest's first boot log a known kernel
// bug's oops while its tests run, as a test of the rerun on it.
func withFakeOopsFirstBoot() Option { return func(c *config) { c.fakeOopsFirstBoot = true } }
