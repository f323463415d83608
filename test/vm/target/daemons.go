package target

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

var daemonMu sync.Mutex

// running reports whether a process with this command name runs.
func running(comm string) bool {
	procs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == comm {
			return true
		}
	}
	return false
}

func startDaemon(t testing.TB, comm string, argv ...string) {
	t.Helper()
	daemonMu.Lock()
	defer daemonMu.Unlock()
	if running(comm) {
		return
	}
	if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("start %s: %v: %s", comm, err, out)
	}
}

// StartIscsid starts the open-iscsi daemon unless it runs already (see
// vm.WithIscsid). It keeps running for the rest of the guest's life.
func StartIscsid(t testing.TB) {
	t.Helper()
	LoadModules(t, "iscsi_tcp", "sd_mod")
	for _, d := range []string{"/run/lock/iscsi", "/var/lib/iscsi"} {
		os.MkdirAll(d, 0o755)
	}
	startDaemon(t, "iscsid", "iscsid")
}

// StartUdevd starts systemd-udevd and replays the coldplug events unless it
// runs already (see vm.WithUdev).
func StartUdevd(t testing.TB) {
	t.Helper()
	daemonMu.Lock()
	up := running("systemd-udevd")
	daemonMu.Unlock()
	if up {
		return
	}
	os.MkdirAll("/run/udev", 0o755)
	startDaemon(t, "systemd-udevd", "/usr/lib/systemd/systemd-udevd", "--daemon")
	for _, args := range [][]string{
		{"trigger", "--type=subsystems", "--action=add"},
		{"trigger", "--type=devices", "--action=add"},
		{"settle", "--timeout=30"},
	} {
		if out, err := exec.Command("udevadm", args...).CombinedOutput(); err != nil {
			t.Fatalf("udevadm %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

// StartMultipathd starts multipathd (and udevd, which it needs) unless it
// runs already (see vm.WithMultipathd).
func StartMultipathd(t testing.TB) {
	t.Helper()
	LoadModules(t, "dm_multipath", "dm_round_robin", "dm_service_time", "dm_queue_length")
	StartUdevd(t)
	os.MkdirAll("/run/multipath", 0o755)
	startDaemon(t, "multipathd", "multipathd")
}

// StartTLSHD starts tlshd, the TLS handshake daemon of the kernel's
// NVMe/TCP (ktls-utils), unless it runs already. The trixie guest image
// has it (test/vm/image/build.sh trixie) as /usr/sbin/tlshd, a wrapper
// that runs Debian 13's binary with that suite's loader, so the process
// is found by its command line. /etc/tlshd.conf links the .nvme keyring.
// Its messages go to /tmp/tlshd.log. It runs for the rest of the
// guest's life.
func StartTLSHD(t testing.TB) {
	t.Helper()
	LoadModules(t, "tls", "nvme_tcp")
	daemonMu.Lock()
	defer daemonMu.Unlock()
	if TLSHDRunning() {
		return
	}
	if _, err := exec.LookPath("tlshd"); err != nil {
		t.Fatalf("tlshd: %v (the guest image has it only with a kernel of another suite: vm.WithKernel(\"trixie\"))", err)
	}
	log, err := os.OpenFile("/tmp/tlshd.log", os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("tlshd", "-s") // -s: log to stderr

	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatalf("start tlshd: %v", err)
	}
	log.Close()
	go cmd.Wait()
	// The kernel hands a handshake to the listeners of the handshake
	// family's multicast group: a connect before tlshd joined it fails
	// at once ("failed to start TLS: -3"), as if no tlshd ran.
	for i := 0; i < 250 && !tlshdListening(); i++ {
		time.Sleep(20 * time.Millisecond)
	}
	if !tlshdListening() {
		b, _ := os.ReadFile("/tmp/tlshd.log")
		t.Fatalf("tlshd did not start listening for handshakes within 5 s (no generic netlink socket of it in a multicast group): %s", b)
	}
}

// tlshdListening reports whether a tlshd process has a generic netlink
// socket in a multicast group (/proc/net/netlink shows the first 32
// groups; the handshake family's is among them in the guests).
func tlshdListening() bool {
	inodes := map[string]bool{}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err != nil || !strings.Contains(string(b), "/usr/sbin/tlshd") || strings.HasPrefix(string(b), "/bin/sh") {
			continue
		}
		fds, _ := filepath.Glob(filepath.Join(filepath.Dir(p), "fd", "*"))
		for _, fd := range fds {
			if to, err := os.Readlink(fd); err == nil && strings.HasPrefix(to, "socket:[") {
				inodes[strings.TrimSuffix(strings.TrimPrefix(to, "socket:["), "]")] = true
			}
		}
	}
	b, err := os.ReadFile("/proc/net/netlink")
	if err != nil {
		return false
	}
	// sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) == 10 && f[1] == "16" && strings.Trim(f[3], "0") != "" && inodes[f[9]] {
			return true
		}
	}
	return false
}

// TLSHDRunning reports whether a tlshd process runs.
func TLSHDRunning() bool {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), "/usr/sbin/tlshd") && !strings.HasPrefix(string(b), "/bin/sh") {
			return true
		}
	}
	return false
}

// StopTLSHD kills every tlshd process.
func StopTLSHD(t testing.TB) {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), "/usr/sbin/tlshd") {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			if proc, err := os.FindProcess(pid); err == nil {
				proc.Kill()
			}
		}
	}
	for i := 0; i < 100 && TLSHDRunning(); i++ {
		time.Sleep(20 * time.Millisecond)
	}
}

// InsertTLSKey loads the PSK of key (interchange format) for hostNQN and
// subNQN into the .nvme keyring as nvme-cli does (check-tls-key
// --insert, with the guest's nvme-trixie: Debian 12's nvme-cli cannot).
// The key is in that command's argv: for the target side of a test.
func InsertTLSKey(t testing.TB, hostNQN, subNQN, key string) {
	t.Helper()
	out, err := exec.Command("nvme-trixie", "check-tls-key", "--insert", "--hostnqn="+hostNQN, "--subsysnqn="+subNQN, "--keydata="+key).CombinedOutput()
	if err != nil {
		t.Fatalf("nvme check-tls-key --insert: %v: %s", err, out)
	}
}
