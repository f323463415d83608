package systemd

import (
	"bufio"
	"bytes"
	_ "embed"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/testutil"
)

// The shipped units, embedded so that in-guest tests have them too.
var (
	//go:embed berth.service
	serviceUnit []byte
	//go:embed berth.socket
	socketUnit []byte
)

// unitValues returns every value of key in a unit file, in order.
func unitValues(t *testing.T, data []byte, key string) []string {
	t.Helper()
	var vals []string
	s := bufio.NewScanner(bytes.NewReader(data))
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") && k == key {
			vals = append(vals, v)
		}
	}
	return vals
}

// TestUnitsVerify runs systemd-analyze verify on the shipped units, with
// ExecStart pointed at an existing executable (verify checks that it is
// one), and fails on any warning, not only on errors: an unknown or
// misspelt hardening key is only a warning to systemd, and silently lost.
func TestUnitsVerify(t *testing.T) {
	tool, err := exec.LookPath("systemd-analyze")
	if err != nil {
		testutil.SkipOrFail(t, "needs systemd-analyze (make deps): "+err.Error())
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	service, socket := serviceUnit, socketUnit
	const bin = "/usr/local/bin/berth"
	if !bytes.Contains(service, []byte("ExecStart="+bin+" ")) {
		t.Fatalf("berth.service: ExecStart does not run %s, which `make install` installs", bin)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "berth.service"), bytes.ReplaceAll(service, []byte(bin), []byte(self)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "berth.socket"), socket, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(tool, "verify", "--man=no", "./berth.socket", "./berth.service")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// TestUnitsAgree checks what systemd cannot: the service serves on the
// socket the socket unit creates, and no option that would move berth into
// a private mount namespace (hiding its mounts from the kubelet) or a device
// cgroup creeps in.
func TestUnitsAgree(t *testing.T) {
	service, socket := serviceUnit, socketUnit
	listen := unitValues(t, socket, "ListenStream")
	if len(listen) != 1 {
		t.Fatalf("berth.socket: %d ListenStream= lines, want 1", len(listen))
	}
	exec := unitValues(t, service, "ExecStart")
	if len(exec) != 1 || !strings.Contains(exec[0], "--endpoint=unix://"+listen[0]) {
		t.Fatalf("berth.service ExecStart=%q does not serve on the socket unit's %s", exec, listen[0])
	}
	if v := unitValues(t, service, "Type"); len(v) != 1 || v[0] != "notify" {
		t.Errorf("Type=%v, want notify", v)
	}
	if v := unitValues(t, service, "WatchdogSec"); len(v) != 1 {
		t.Errorf("WatchdogSec=%v, want one value", v)
	}
	for _, key := range []string{
		"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts", "MountFlags",
		"ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem",
		"ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
		"ProtectControlGroups", "ProtectProc", "ProtectClock", "PrivateDevices",
		"DeviceAllow", "DevicePolicy", "PrivateNetwork", "NetworkNamespacePath",
		"RootDirectory", "RootImage", "BindPaths", "BindReadOnlyPaths", "PrivateUsers",
	} {
		if v := unitValues(t, service, key); len(v) > 0 {
			t.Errorf("berth.service sets %s=%v: berth would lose the host's mounts, devices or uevents", key, v)
		}
	}
}

// unitList returns the units every key= line of a unit file lists.
func unitList(t *testing.T, data []byte, key string) []string {
	t.Helper()
	var units []string
	for _, v := range unitValues(t, data, key) {
		units = append(units, strings.Fields(v)...)
	}
	return units
}

// TestUnitsShutdownOrder checks the order systemd stops berth in, the
// reverse of the start order: after the kubelet, whose last unpublish and
// unstage calls must reach berth, and before the network and the
// initiator's daemons, which those calls need. The main package checks
// TimeoutStopSec against berth's --shutdown-timeout.
func TestUnitsShutdownOrder(t *testing.T) {
	after, before := unitList(t, serviceUnit, "After"), unitList(t, serviceUnit, "Before")
	for _, u := range []string{"network.target", "network-online.target", "iscsid.service", "iscsid.socket", "multipathd.service"} {
		if !slices.Contains(after, u) {
			t.Errorf("berth.service is not After=%s: at shutdown %s may stop while berth still unmounts and detaches", u, u)
		}
		if slices.Contains(before, u) {
			t.Errorf("berth.service is Before=%s: at shutdown berth would outlive it", u)
		}
	}
	if !slices.Contains(unitList(t, serviceUnit, "Wants"), "network-online.target") {
		t.Error("berth.service does not want network-online.target: After= it alone waits for nothing at boot")
	}
	if !slices.Contains(before, "kubelet.service") || slices.Contains(after, "kubelet.service") {
		t.Errorf("berth.service Before=%v After=%v: want Before=kubelet.service, so that the kubelet stops first", before, after)
	}
	if v := unitValues(t, serviceUnit, "DefaultDependencies"); len(v) > 0 {
		t.Errorf("berth.service sets DefaultDependencies=%v: without them it is not stopped before shutdown.target", v)
	}
	if v := unitValues(t, serviceUnit, "KillMode"); len(v) != 1 || v[0] != "mixed" {
		t.Errorf("KillMode=%v, want mixed: SIGTERM to berth alone, so that the programs its calls run finish with them", v)
	}
}
