package vm

import (
	"bufio"
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

//go:embed init.sh
var initScript []byte

const (
	exitMarker   = "BERTH-VM-EXIT "
	startMarker  = "BERTH-VM-START"
	signalMarker = "BERTH-VM-SIGNAL "
	consoleKeep  = 60
)

// A Machine is a running (or finished) guest.
type Machine struct {
	t    testing.TB
	name string
	cfg  *config
	dir  string
	args []string // QEMU argv
	// peers are the links this guest joins second: QEMU connects once,
	// at its start, and a link whose listener is not there yet stays
	// dead (the connecting QEMU does not try again).
	peers []*Link

	cmd     *exec.Cmd
	done    chan struct{} // closed when QEMU exited and its streams are drained
	started time.Time
	booted  time.Duration // until the test binary started

	mu       sync.Mutex
	cond     *sync.Cond
	console  []string // last consoleKeep lines
	exitCode int      // from the exit marker; -1 when the guest never reported
	panicked bool
	timedOut bool
	killed   bool
	retry    bool // the boot watchdog killed a guest that never started
	exited   bool // QEMU exited and its output was read
	waitErr  error
	signals  map[string]bool
	guestOut bytes.Buffer // raw in-guest test output (CR stripped)
	events   []testEvent
	cover    coverFiles // coverage files sent by the guest (CoverDirEnv)
	coverErr error
	conn     net.Conn

	stepRounds map[string]int // the host's Step calls, by step name
}

var machineSeq atomic.Uint32

// Boot builds and starts a guest running this package's test binary and
// returns without waiting for it. The guest is killed when the test ends.
// Use Wait and ReportTests, or RunGuestTests for the one-guest case.
func Boot(t testing.TB, opts ...Option) *Machine {
	t.Helper()
	cfg := defaultConfig()
	for _, o := range opts {
		o(cfg)
	}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.name == "" {
		cfg.name = t.Name()
	}
	if InGuest() {
		t.Skip("vm: host entry point; inside a guest it has nothing to do")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		unavailable(t, "qemu-system-x86_64 not found (run make deps): %v", err)
	}
	if os.Geteuid() != 0 {
		unavailable(t, "the VM image is built as root (mmdebstrap): run as root")
	}
	t0 := time.Now()
	img, buildLog, err := loadImage(cfg.kernel)
	if err != nil {
		unavailable(t, "guest image: %v", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Logf("vm: image build took %v:\n%s", d.Round(time.Millisecond), buildLog)
	}

	m := &Machine{
		t: t, name: cfg.name, cfg: cfg,
		done:     make(chan struct{}),
		exitCode: -1,
		signals:  map[string]bool{},
	}
	m.cond = sync.NewCond(&m.mu)
	m.dir, err = os.MkdirTemp("", "berth-vm-run-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.Kill()
		<-m.done
		if t.Failed() {
			t.Logf("vm %s: run directory kept: %s", m.name, m.dir)
			return
		}
		os.RemoveAll(m.dir)
	})
	if err := m.prepare(img); err != nil {
		close(m.done)
		t.Fatalf("vm %s: %v", m.name, err)
	}
	if err := m.start(); err != nil {
		close(m.done)
		t.Fatalf("vm %s: %v", m.name, err)
	}
	return m
}

// unavailable skips, or fails under BERTH_CI=1.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("BERTH_CI") == "1" {
		t.Fatalf("vm: "+format+" (BERTH_CI=1: a VM test that cannot run is a failure)", args...)
	}
	t.Skipf("vm: "+format+" (skipping; BERTH_CI=1 makes this a failure)", args...)
}

// prepare builds the binaries and the initramfs of this run and the QEMU argv.
func (m *Machine) prepare(img *image) error {
	cfg := m.cfg
	t0 := time.Now()
	pkgDir, err := filepath.Abs(cfg.pkgDir)
	if err != nil {
		return err
	}
	testBin, err := testBinary(pkgDir)
	if err != nil {
		return err
	}
	berth, err := buildBerth(cfg.berthTags)
	if err != nil {
		return err
	}
	tBuild := time.Since(t0)

	// The per-run archive, appended to the cached base archive.
	initrd := filepath.Join(m.dir, "initrd")
	f, err := os.Create(initrd)
	if err != nil {
		return err
	}
	defer f.Close()
	base, err := os.Open(img.baseInitramfs)
	if err != nil {
		return err
	}
	n, err := io.Copy(f, base)
	base.Close()
	if err != nil {
		return err
	}
	// The kernel looks for the next archive at a 4-byte boundary, skipping zeros.
	if _, err := f.Write(make([]byte, (4-n%4)%4)); err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	c := newCPIOWriter(bw)
	c.Bytes("init", 0o755, initScript)
	c.Bytes("berth-vm/init.sh", 0o755, initScript)
	c.Bytes("berth-vm/config.sh", 0o644, m.configScript(img))
	c.File("berth-vm/guest.test", testBin)
	c.File("usr/bin/berth", berth)
	c.Dir("berth-vm/pkg")
	if td := filepath.Join(pkgDir, "testdata"); fileExists(td) {
		c.File("berth-vm/pkg/testdata", td)
	}
	hosts := make([]string, 0, len(cfg.files))
	for h := range cfg.files {
		hosts = append(hosts, h)
	}
	sort.Strings(hosts)
	for _, h := range hosts {
		c.File(cfg.files[h], h)
	}
	if err := c.Close(); err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}

	seq := machineSeq.Add(1)
	cmdline := "console=ttyS0 panic=-1 quiet net.ifnames=0 rdinit=/init"
	if img.kernelArgs != "" {
		cmdline += " " + img.kernelArgs
	}
	for _, a := range cfg.kernelArgs {
		cmdline += " " + a
	}
	m.args = []string{
		"qemu-system-x86_64",
		"-nodefaults", "-display", "none", "-no-reboot",
		"-accel", tcgAccel(img.kernelVersion), "-cpu", "max",
		"-smp", strconv.Itoa(cfg.cpus), "-m", strconv.Itoa(cfg.memoryMB),
		"-kernel", img.kernel, "-initrd", initrd,
		"-append", cmdline,
		"-serial", "stdio",
		"-chardev", "socket,id=io,path=" + filepath.Join(m.dir, "io.sock"),
		"-serial", "chardev:io",
	}
	for i, n := range cfg.nics {
		netdev, err := n.link.netdev()
		if err != nil {
			return err
		}
		if strings.HasPrefix(netdev, "connect=") {
			m.peers = append(m.peers, n.link)
		}
		m.args = append(m.args,
			"-netdev", fmt.Sprintf("socket,id=n%d,%s", i, netdev),
			"-device", fmt.Sprintf("virtio-net-pci,netdev=n%d,mac=52:54:00:%02x:%02x:%02x", i, os.Getpid()&0xff, seq&0xff, i))
	}
	if cfg.systemd {
		if img.rootDisk == "" || !fileExists(img.rootDisk) {
			return errors.New("WithSystemd: the image has no root disk")
		}
		m.args = append(m.args, "-drive", "file="+img.rootDisk+",if=virtio,format=raw,snapshot=on")
	}
	m.t.Logf("vm %s: built test binary and initramfs in %v", m.name, tBuild.Round(time.Millisecond))
	return nil
}

// configScript is /berth-vm/config.sh, sourced by the guest's init.
func (m *Machine) configScript(img *image) []byte {
	cfg := m.cfg
	var b bytes.Buffer
	set := func(k, v string) { fmt.Fprintf(&b, "%s=%s\n", k, shellQuote(v)) }
	flag := func(k string, v bool) {
		if v {
			set(k, "1")
		}
	}
	set("BERTH_VM_HOSTNAME", sanitizeHost(m.name))
	set("BERTH_VM_MODULES", strings.Join(cfg.modules, " "))
	var nics []string
	for _, n := range cfg.nics {
		nics = append(nics, n.addr)
	}
	set("BERTH_VM_NICS", strings.Join(nics, " "))
	flag("BERTH_VM_UDEV", cfg.udev)
	flag("BERTH_VM_ISCSID", cfg.iscsid)
	flag("BERTH_VM_MULTIPATHD", cfg.multipathd)
	flag("BERTH_VM_SYSTEMD", cfg.systemd)
	var files []string
	for _, g := range cfg.files {
		files = append(files, g)
	}
	sort.Strings(files)
	set("BERTH_VM_FILES", strings.Join(files, " "))
	fmt.Fprintf(&b, "export BERTH_VM_GUEST=1\n")
	fmt.Fprintf(&b, "export BERTH_VM_KERNEL=%s\n", shellQuote(img.kernelVersion))
	keys := make([]string, 0, len(cfg.env))
	for k := range cfg.env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "export %s=%s\n", k, shellQuote(cfg.env[k]))
	}
	guestTimeout := cfg.timeout - 20*time.Second
	args := []string{"-test.v=test2json", "-test.timeout=" + guestTimeout.String()}
	if coverDir() != "" {
		set("BERTH_VM_COVER", "1")
		// Programs the test runs that were built with -cover too.
		fmt.Fprintf(&b, "export GOCOVERDIR=%s\n", guestCoverDir)
		args = append(args, "-test.gocoverdir="+guestCoverDir)
	}
	if cfg.run != "" {
		args = append(args, "-test.run="+cfg.run)
	}
	args = append(args, cfg.testArgs...)
	b.WriteString("set --")
	for _, a := range args {
		b.WriteString(" " + shellQuote(a))
	}
	b.WriteString("\n")
	return b.Bytes()
}

// tcgAccel is QEMU's -accel for a guest of kernelVersion. Kernels from 7
// (Debian 13 backports' 7.3) patch their text at boot and at run time with
// int3 breakpoints (static branches, text_poke_bp) while the other vCPU
// runs; under multi-threaded TCG a vCPU now and then executes the int3 of
// a patch its sibling has already finished and the kernel oopses ("Oops:
// int3" in sched_clock_cpu, in ktime_get_update_offsets_now: about one
// boot in twenty, and a three-guest test boots three). One host thread for
// all vCPUs (thread=single) keeps the translated code coherent with the
// patches; the guests keep their two vCPUs.
func tcgAccel(kernelVersion string) string {
	major, _, _ := strings.Cut(kernelVersion, ".")
	if n, err := strconv.Atoi(major); err == nil && n >= 7 {
		return "tcg,thread=single"
	}
	return "tcg"
}

func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func sanitizeHost(s string) string {
	s = regexp.MustCompile(`[^A-Za-z0-9-]+`).ReplaceAllString(s, "-")
	if len(s) > 60 {
		s = s[:60]
	}
	return strings.Trim(s, "-")
}

// maxBootWait bounds how long a guest may take from QEMU's start to its
// test binary's start (normally 2 to 30 s) before the boot watchdog
// gives up on it.
const maxBootWait = 150 * time.Second

// start launches QEMU and the goroutines that read its serial ports.
func (m *Machine) start() error { return m.launch(1) }

// launch starts one attempt to run the guest. A guest whose init never
// starts the tests within the boot deadline (a kernel stuck early in boot
// under an overloaded TCG host, which prints nothing with "quiet") is
// killed and booted once more, with the kernel's messages on, so that a
// second hang shows where it stops; the first attempt's console goes to
// the test log.
func (m *Machine) launch(attempt int) error {
	for _, l := range m.peers {
		if err := l.waitListening(linkWait); err != nil {
			return fmt.Errorf("vm %s: %w", m.name, err)
		}
	}
	ln, err := net.Listen("unix", filepath.Join(m.dir, "io.sock"))
	if err != nil {
		return err
	}
	args := slices.Clone(m.args)
	for i, a := range args {
		switch {
		case i == 0 || args[i-1] != "-append":
		case attempt > 1:
			args[i] = strings.Replace(a, " quiet", " loglevel=7", 1)
		case m.cfg.hangFirstBoot:
			args[i] = a + " berth_vm_hang"
		case m.cfg.fakeOopsFirstBoot:
			args[i] = a + " " + fakeOopsArg
		}
	}
	cmd := exec.Command(args[0], args[1:]...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		ln.Close()
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		ln.Close()
		return fmt.Errorf("start %s: %w", m.Command(), err)
	}
	m.mu.Lock()
	m.cmd = cmd
	m.started = time.Now()
	killed := m.killed
	m.mu.Unlock()
	if killed { // Kill ran while this attempt started
		cmd.Process.Kill()
	}
	m.t.Logf("vm %s: booting: %s", m.name, strings.Join(args, " "))

	// QEMU connects to the socket while it starts; it exits on failure.
	connc := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		ln.Close()
		if err != nil {
			close(connc)
			return
		}
		connc <- c
	}()

	j, err := newTest2JSON(m.name)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return err
	}

	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // console
		defer wg.Done()
		m.readConsole(stdout, attempt)
	}()
	go func() { // test output
		defer wg.Done()
		c, ok := <-connc
		if !ok {
			return
		}
		m.mu.Lock()
		m.conn = c
		m.mu.Unlock()
		m.readGuestOutput(c, j)
	}()
	timer := time.AfterFunc(m.cfg.timeout, func() {
		m.mu.Lock()
		m.timedOut = true
		m.mu.Unlock()
		cmd.Process.Kill()
	})
	bootWait := min(m.cfg.timeout/2, maxBootWait)
	watchdog := time.AfterFunc(bootWait, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.booted != 0 || m.killed || attempt > 1 {
			return
		}
		if len(m.cfg.nics) > 0 {
			// A QEMU started again would find its link's other end
			// gone or taken: the link would stay dead.
			m.t.Logf("vm %s: the guest did not start its tests within %v; killing it (a guest on a private link is not booted again)\n%s",
				m.name, bootWait, m.diagnosticsLocked())
			cmd.Process.Kill()
			return
		}
		m.retry = true
		m.t.Logf("vm %s: the guest did not start its tests within %v; killing it and booting once more\n%s",
			m.name, bootWait, m.diagnosticsLocked())
		cmd.Process.Kill()
	})
	go func() {
		err := cmd.Wait()
		timer.Stop()
		watchdog.Stop()
		ln.Close()
		m.mu.Lock()
		retry := m.retry && !m.killed
		if !retry {
			m.waitErr = err
		}
		m.mu.Unlock()
		wg.Wait()
		events, jerr := j.finish()
		if retry {
			m.mu.Lock()
			m.retry = false
			m.console, m.conn, m.booted, m.exitCode, m.panicked = nil, nil, 0, -1, false
			m.guestOut.Reset()
			m.signals = map[string]bool{}
			m.mu.Unlock()
			err := m.launch(attempt + 1)
			if err == nil {
				return
			}
			m.mu.Lock()
			m.waitErr = fmt.Errorf("boot again: %w", err)
			m.mu.Unlock()
		}
		m.mu.Lock()
		m.events = events
		if jerr != nil && m.waitErr == nil {
			m.waitErr = jerr
		}
		m.exited = true
		m.cond.Broadcast()
		m.mu.Unlock()
		close(m.done)
	}()
	return nil
}

func (m *Machine) readConsole(r io.Reader, attempt int) {
	var oops string // the "BUG:" or "Oops:" line of the oops being printed
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		m.mu.Lock()
		m.console = append(m.console, line)
		if len(m.console) > consoleKeep {
			m.console = m.console[len(m.console)-consoleKeep:]
		}
		if s, ok := strings.CutPrefix(line, exitMarker); ok {
			if n, err := strconv.Atoi(strings.TrimSpace(s)); err == nil {
				m.exitCode = n
			}
		}
		if strings.HasPrefix(line, startMarker) && m.booted == 0 {
			m.booted = time.Since(m.started)
		}
		if strings.Contains(line, "Kernel panic") {
			m.panicked = true
		}
		if strings.Contains(line, "BUG: ") || strings.Contains(line, "Oops: ") {
			oops = line
		}
		if bug := knownKernelBug(oops, line); oops != "" && bug != "" &&
			m.cfg.rerunOnKernelBug && len(m.cfg.nics) == 0 && attempt == 1 && !m.killed && !m.retry {
			m.retry = true
			m.t.Logf("vm %s: the guest kernel hit a known bug of its own (%s): %s / %s; "+
				"killing the guest and running its tests once more\n%s",
				m.name, bug, strings.TrimSpace(oops), strings.TrimSpace(line), m.diagnosticsLocked())
			m.cmd.Process.Kill()
		}
		m.mu.Unlock()
		m.t.Logf("%s console: %s", m.name, line)
	}
}

func (m *Machine) readGuestOutput(r io.Reader, j *test2json) {
	br := bufio.NewReader(r)
	for {
		line, err := br.ReadString('\n')
		if len(line) > 0 {
			line = strings.ReplaceAll(line, "\r", "")
			if rest, ok := strings.CutPrefix(line, coverMarker); ok {
				m.mu.Lock()
				if m.cover == nil {
					m.cover = coverFiles{}
				}
				if err := m.cover.add(rest); err != nil && m.coverErr == nil {
					m.coverErr = err
				}
				m.mu.Unlock()
				line = ""
			}
		}
		if len(line) > 0 {
			j.write(line)
			m.mu.Lock()
			m.guestOut.WriteString(line)
			if s, ok := strings.CutPrefix(line, exitMarker); ok {
				if n, err := strconv.Atoi(strings.TrimSpace(s)); err == nil {
					m.exitCode = n
				}
			}
			if i := strings.Index(line, signalMarker); i >= 0 {
				m.signals[strings.TrimSpace(line[i+len(signalMarker):])] = true
				m.cond.Broadcast()
			}
			m.mu.Unlock()
		}
		if err != nil {
			m.mu.Lock()
			if d := coverDir(); d != "" && m.coverErr == nil {
				m.coverErr = m.cover.write(d)
			}
			m.mu.Unlock()
			return
		}
	}
}

// Command is the QEMU command line of this guest, shell-quoted.
func (m *Machine) Command() string {
	q := make([]string, len(m.args))
	for i, a := range m.args {
		if regexp.MustCompile(`^[A-Za-z0-9_./:=,@+-]+$`).MatchString(a) {
			q[i] = a
		} else {
			q[i] = shellQuote(a)
		}
	}
	return strings.Join(q, " ")
}

// reproduce tells how to rerun the guest by hand, with the test output in a file.
func (m *Machine) reproduce() string {
	cmd := strings.Replace(m.Command(), "socket,id=io,path="+filepath.Join(m.dir, "io.sock"),
		"file,id=io,path="+filepath.Join(m.dir, "guest-output.txt"), 1)
	return "reproduce with (test output in " + filepath.Join(m.dir, "guest-output.txt") + "):\n  " + cmd
}

// Output is the in-guest test binary's output so far (test2json framing
// included, carriage returns removed).
func (m *Machine) Output() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.guestOut.String()
}

// Kill stops the guest at once (like pulling the power cord).
func (m *Machine) Kill() {
	m.mu.Lock()
	m.killed = true
	cmd := m.cmd
	m.mu.Unlock()
	if cmd != nil && cmd.Process != nil {
		cmd.Process.Kill()
	}
}

// Pause freezes the guest's QEMU process (SIGSTOP): its vCPUs and
// devices stop as a hung node's do, its network peers see it go silent,
// and Resume lets it go on where it was, its clock behind.
func (m *Machine) Pause() { m.signal(syscall.SIGSTOP) }

// Resume lets a paused guest go on (SIGCONT).
func (m *Machine) Resume() { m.signal(syscall.SIGCONT) }

func (m *Machine) signal(sig syscall.Signal) {
	m.t.Helper()
	m.mu.Lock()
	cmd := m.cmd
	m.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		m.t.Fatalf("vm %s: not running", m.name)
	}
	if err := cmd.Process.Signal(sig); err != nil {
		m.t.Fatalf("vm %s: %v: %v", m.name, sig, err)
	}
}

// Done is closed when the guest has stopped.
func (m *Machine) Done() <-chan struct{} { return m.done }

// Wait waits for the guest to stop (it powers off after its tests).
func (m *Machine) Wait() { <-m.done }

// BootTime is the time from starting QEMU to starting the test binary.
func (m *Machine) BootTime() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.booted
}
