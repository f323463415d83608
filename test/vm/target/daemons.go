package target

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
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
