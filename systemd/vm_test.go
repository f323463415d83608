package systemd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/berth-csi/berth/test/vm"
)

// TestVMSystemd runs the shipped units under a real systemd: socket
// activation, READY=1, the hardening (mounts must reach the host), journal
// fields, a restart by the watchdog once Probe hangs, an NVMe/TCP
// volume that stays mounted across `systemctl restart berth`, and a
// fenced iSCSI volume (the reservation read needs the unit's capabilities).
func TestVMSystemd(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithSystemd(), vm.WithIscsid(), vm.WithTestRun("^TestGuestSystemd"), vm.WithTimeout(8*time.Minute))
}

func systemctl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("systemctl", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("systemctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func unitProps(t *testing.T, unit string) map[string]string {
	t.Helper()
	out := systemctl(t, "show", unit, "-p", "ActiveState,SubState,MainPID,NRestarts,StatusText,Result")
	props := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			props[k] = v
		}
	}
	return props
}

// waitUnit polls systemctl show until cond holds (test code: systemd has
// no event stream the test could wait on without D-Bus).
func waitUnit(t *testing.T, unit, what string, timeout time.Duration, cond func(map[string]string) bool) map[string]string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		p := unitProps(t, unit)
		if cond(p) {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s not reached within %s: %v", unit, what, timeout, p)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func pluginPid(t *testing.T, sock string) string {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetPluginInfo through %s: %v", sock, err)
	}
	return info.GetVendorVersion()
}

func TestGuestSystemdUnits(t *testing.T) {
	vm.RequireGuest(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	service := serviceUnit
	sock := unitValues(t, socketUnit, "ListenStream")[0]
	mnt := t.TempDir()

	// The shipped service, running this test binary as the CSI server and
	// with a short watchdog; every hardening line stays as shipped.
	var unit bytes.Buffer
	s := bufio.NewScanner(bytes.NewReader(service))
	for s.Scan() {
		line := s.Text()
		switch {
		case strings.HasPrefix(line, "ExecStart="):
			line = "ExecStart=" + self + "\nEnvironment=" + childEnv + "=" + sock + " " + childMountEnv + "=" + mnt
		case strings.HasPrefix(line, "WatchdogSec="):
			line = "WatchdogSec=6s"
		}
		unit.WriteString(line + "\n")
	}
	startUnits(t, unit.Bytes())
	if p := unitProps(t, "berth.service"); p["ActiveState"] != "inactive" {
		t.Fatalf("berth.service started before any connection: %v", p)
	}

	// The first connection starts the service; READY=1 makes it active.
	pid := pluginPid(t, sock)
	p := waitUnit(t, "berth.service", "active", 30*time.Second, func(p map[string]string) bool { return p["ActiveState"] == "active" })
	if p["MainPID"] != pid || p["StatusText"] != "serving CSI requests" {
		t.Fatalf("berth.service %v; the server that answered is pid %s", p, pid)
	}

	// The hardening kept berth in the host's mount namespace.
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mnt))
	if err != nil || len(mounts) != 1 || mounts[0].FSType != "tmpfs" {
		t.Fatalf("the tmpfs berth mounted at %s is not visible outside the service (%v, %v): the unit gave it a private mount namespace", mnt, mounts, err)
	}
	t.Cleanup(func() {
		// Each start of the service mounted once more.
		for i := 0; i < 10 && unix.Unmount(mnt, 0) == nil; i++ {
		}
	})

	// Healthy for two watchdog intervals: no restart.
	time.Sleep(12 * time.Second)
	if p := unitProps(t, "berth.service"); p["NRestarts"] != "0" || p["MainPID"] != pid {
		t.Fatalf("berth.service restarted while healthy: %v", p)
	}

	// Wedge Probe: the pings stop and systemd restarts berth.
	pidNum, _ := strconv.Atoi(pid)
	if err := exec.Command("kill", "-USR1", strconv.Itoa(pidNum)).Run(); err != nil {
		t.Fatal(err)
	}
	p = waitUnit(t, "berth.service", "a watchdog restart", 60*time.Second, func(p map[string]string) bool {
		return p["NRestarts"] == "1" && p["ActiveState"] == "active" && p["MainPID"] != pid && p["MainPID"] != "0"
	})
	if np := pluginPid(t, sock); np != p["MainPID"] {
		t.Fatalf("after the restart pid %s answers, MainPID is %s", np, p["MainPID"])
	}

	// The journal has systemd's verdict and berth's record as fields.
	out, err := exec.Command("journalctl", "--no-pager", "-o", "json", "-u", "berth.service").Output()
	if err != nil {
		t.Fatal(err)
	}
	var sawTimeout, sawFields bool
	for _, l := range strings.Split(string(out), "\n") {
		var e map[string]any
		if json.Unmarshal([]byte(l), &e) != nil {
			continue
		}
		msg, _ := e["MESSAGE"].(string)
		errField, _ := e["ERROR"].(string)
		if strings.Contains(msg, "Watchdog timeout") {
			sawTimeout = true
		}
		if strings.HasPrefix(msg, "liveness check failed") && e["_PID"] == pid &&
			e["PRIORITY"] == "3" && e["SYSLOG_IDENTIFIER"] == "berth" && e["WATCHDOG_INTERVAL"] == "6" &&
			errField != "" {
			sawFields = true
		}
	}
	if !sawTimeout || !sawFields {
		t.Fatalf("journal: watchdog timeout %v, structured liveness record %v\n%s", sawTimeout, sawFields, out)
	}

	// Orderly stop: STOPPING=1, then a clean exit.
	systemctl(t, "stop", "berth.service")
	if p := unitProps(t, "berth.service"); p["ActiveState"] != "inactive" || p["Result"] != "success" {
		t.Fatalf("after stop: %v", p)
	}
}

// TestGuestSystemdBerth starts the real berth through the shipped units,
// changed only in the binary's path (/usr/bin/berth in the guest).
func TestGuestSystemdBerth(t *testing.T) {
	vm.RequireGuest(t)
	sock := installBerth(t)

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err != nil || info.GetName() != "berth.csi.io" {
		t.Fatalf("GetPluginInfo through %s: %v, %v", sock, info, err)
	}
	p := waitUnit(t, "berth.service", "active", 30*time.Second, func(p map[string]string) bool { return p["ActiveState"] == "active" })
	if p["StatusText"] != "serving CSI requests" || p["NRestarts"] != "0" {
		t.Fatalf("berth.service: %v", p)
	}
	pid := p["MainPID"]

	out, err := exec.Command("journalctl", "--no-pager", "-o", "json", "-u", "berth.service").Output()
	if err != nil {
		t.Fatal(err)
	}
	serving := false
	for _, l := range strings.Split(string(out), "\n") {
		var e map[string]any
		if json.Unmarshal([]byte(l), &e) != nil {
			continue
		}
		if e["MESSAGE"] == "serving" && e["_PID"] == pid && e["SYSLOG_IDENTIFIER"] == "berth" &&
			e["DRIVER"] == "berth.csi.io" && e["ENDPOINT"] == sock {
			serving = true
		}
	}
	if !serving {
		t.Fatalf("no structured \"serving\" record from pid %s in the journal:\n%s", pid, out)
	}

	// The unit registers berth with the kubelet: the kubelet's plugin
	// watcher would find this socket and be sent to berth's CSI socket.
	reg := "/var/lib/kubelet/plugins_registry/berth.csi.io-reg.sock"
	rconn, err := grpc.NewClient("unix://"+reg, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer rconn.Close()
	pi, err := registerapi.NewRegistrationClient(rconn).GetInfo(ctx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
	if err != nil || pi.Type != registerapi.CSIPlugin || pi.Name != "berth.csi.io" || pi.Endpoint != sock {
		t.Fatalf("GetInfo on %s: %v, %v; want the CSI plugin berth.csi.io at %s", reg, pi, err, sock)
	}

	systemctl(t, "stop", "berth.service")
	if p := unitProps(t, "berth.service"); p["ActiveState"] != "inactive" || p["Result"] != "success" {
		t.Fatalf("after stop: %v", p)
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("socket %s after berth stopped: %v %v", sock, fi, err)
	}
	// The registration socket goes with berth (the kubelet unregisters
	// the driver); the CSI socket stays, held by systemd.
	if _, err := os.Lstat(reg); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("registration socket %s after berth stopped: %v", reg, err)
	}
}
