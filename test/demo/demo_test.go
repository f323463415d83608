package demo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/test/demo/steps"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// marker starts every line meant for the demo's table.
const marker = "DEMO| "

// TestDemoVM boots one guest and runs the NVMe/TCP and the iSCSI demo in
// it. It is not a TestVM* test: make vm-test leaves it out, and it runs
// only when BERTH_DEMO=1 (scripts/demo.sh).
func TestDemoVM(t *testing.T) {
	if os.Getenv("BERTH_DEMO") != "1" {
		t.Skip("the VM demo runs through make demo (set BERTH_DEMO=1 to run it here)")
	}
	m := vm.Boot(t,
		vm.WithName("demo"),
		vm.WithTestRun("^TestGuestDemo(NVMe|ISCSI)$"),
		vm.WithIscsid(),
		vm.WithModules("nvme_tcp", "nvmet_tcp", "iscsi_tcp", "sd_mod", "target_core_iblock", "iscsi_target_mod", "loop", "xfs"),
		vm.WithTimeout(5*time.Minute))
	m.ReportTests(t)
	t.Log(marker + fmt.Sprintf("guest: booted in %v (QEMU start to test binary)", m.BootTime().Round(time.Millisecond)))
}

// printer returns the steps' output function: each line goes to the test
// log behind the marker.
func printer(t *testing.T) func(string) {
	return func(line string) { t.Log(marker + line) }
}

// startBerth runs /usr/bin/berth serve on a socket in a temporary
// directory with both network transports and returns a connection to it.
// berth's log is shown when the test fails. Cleanup stops berth with
// SIGTERM.
func startBerth(t *testing.T) *grpc.ClientConn {
	t.Helper()
	dir := t.TempDir()
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	logPath := filepath.Join(dir, "berth.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/usr/bin/berth", "serve", "--endpoint", endpoint, "--state-dir", filepath.Join(dir, "state"),
		"--node-id", "demo-guest", "--transports", "nvmeof,iscsi", "--log-format", "text")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logFile.Close()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		cmd.Process.Signal(syscall.SIGTERM)
		err := cmd.Wait()
		if err != nil {
			t.Errorf("berth serve: %v", err)
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("--- berth log ---\n%s", b)
		}
	})
	return conn
}

// unstageOnFailure unstages the volume when the test failed half-way, so
// that the target's teardown finds no initiator attached.
func unstageOnFailure(t *testing.T, conn *grpc.ClientConn, v *steps.Volume) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		node := csi.NewNodeClient(conn)
		node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.ID, TargetPath: filepath.Join(v.Work, "pod", "volume")})
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.ID, StagingTargetPath: filepath.Join(v.Work, "staging")}); err != nil {
			t.Logf("cleanup: NodeUnstageVolume: %v", err)
		}
	})
}

// workDir is a short directory for a volume's staging and target paths
// (the guest is thrown away afterwards; short paths keep the table
// readable).
func workDir(t *testing.T, name string) string {
	dir := filepath.Join("/run/demo", name)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	return dir
}

// sysfsIdentity checks that /sys/class/block/<dev>/<attr> reads want.
func sysfsIdentity(dev, attr, want string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/sys/class/block", filepath.Base(dev), attr))
	if err != nil {
		return "", err
	}
	if got := strings.TrimSpace(string(b)); got != want {
		return "", fmt.Errorf("%s %s is %q, want %q: not the volume's device", dev, attr, got, want)
	}
	short := want
	if len(short) > 20 {
		short = short[:20] + "…"
	}
	return filepath.Base(attr) + " " + short, nil
}

// TestGuestDemoNVMe: an ext4 volume on an nvmet namespace over NVMe/TCP.
func TestGuestDemoNVMe(t *testing.T) {
	vm.RequireGuest(t)
	out := printer(t)
	out("== NVMe/TCP volume, berth serving CSI in the guest")
	const nqn, port = "nqn.2026-01.io.berth:demo", "127.0.0.1:4420"
	t0 := time.Now()
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{port},
		Namespaces: []target.NVMeNamespace{{Size: 256 << 20}}})
	ns := tgt.Namespace(1)
	out(fmt.Sprintf("target: nvmet subsystem %s, namespace 1 (%d MiB, uuid %s) on %s, set up in %v",
		nqn, ns.Size>>20, ns.UUID, port, time.Since(t0).Round(time.Millisecond)))
	conn := startBerth(t)
	host, _, _ := strings.Cut(port, ":")
	v := steps.Volume{
		ID:     "demo-nvme",
		FsType: "ext4",
		Work:   workDir(t, "nvme"),
		Context: map[string]string{"transport": "nvmeof", "nqn": nqn, "traddr": host, "trsvcid": "4420",
			"nsid": "1", "uuid": ns.UUID},
		GrowStep: "grow the nvmet namespace",
		GrowTo:   512 << 20,
		Grow: func(_ context.Context, size int64) error {
			tgt.Grow(1, size)
			return nil
		},
		Identify: func(dev string) (string, error) {
			return sysfsIdentity(dev, "uuid", ns.UUID)
		},
		Detached: func() (string, error) { return noNVMeController(nqn) },
		Restage:  true,
	}
	unstageOnFailure(t, conn, &v)
	if err := steps.New(conn, out).Lifecycle(v); err != nil {
		t.Fatal(err)
	}
}

// noNVMeController checks that no NVMe controller of subsystem nqn is left.
func noNVMeController(nqn string) (string, error) {
	ents, err := os.ReadDir("/sys/class/nvme")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
		if err == nil && strings.TrimSpace(string(b)) == nqn {
			return "", fmt.Errorf("controller %s of %s still connected", e.Name(), nqn)
		}
	}
	return "disconnected (no controller of the subsystem)", nil
}

// TestGuestDemoISCSI: an xfs volume on a LIO LUN whose ACL admits only
// this initiator with CHAP.
func TestGuestDemoISCSI(t *testing.T) {
	vm.RequireGuest(t)
	out := printer(t)
	out("== iSCSI volume with CHAP, berth serving CSI in the guest")
	const (
		iqn    = "iqn.2026-01.io.berth:demo"
		portal = "127.0.0.1:3260"
		serial = "b3e7a1c0de4d40008000000000000001" // hex; LIO makes the NAA WWID from it
		user   = "berth-demo"
		pass   = "Demo-Chap-Pw-16c" // LIO takes 12 to 16 characters
	)
	t0 := time.Now()
	initiator := target.InitiatorName(t)
	tgt := target.NewISCSITarget(t, target.ISCSIConfig{IQN: iqn, Portals: []string{portal},
		LUNs:       []target.ISCSILUN{{Size: 300 << 20, Serial: serial}},
		Initiators: []target.ISCSIInitiator{{IQN: initiator, CHAP: &target.CHAP{User: user, Password: pass}}}})
	out(fmt.Sprintf("target: LIO %s, LUN 0 (%d MiB) on %s, ACL %s with CHAP user %s, set up in %v",
		iqn, tgt.LUN(0).Size>>20, portal, initiator, user, time.Since(t0).Round(time.Millisecond)))
	conn := startBerth(t)
	secrets := map[string]string{"node.session.auth.username": user, "node.session.auth.password": pass}
	v := steps.Volume{
		ID:     "demo-iscsi",
		FsType: "xfs",
		Work:   workDir(t, "iscsi"),
		Context: map[string]string{"transport": "iscsi", "targetPortal": portal, "iqn": iqn, "lun": "0",
			"sessionCHAPAuth": "true", "wwid": "naa.6001405" + serial[:25]},
		Secrets:        secrets,
		RefusedSecrets: map[string]string{"node.session.auth.username": user, "node.session.auth.password": "Not-The-Password"},
		RefusedCode:    codes.PermissionDenied,
		RefusedWhy:     "CHAP authentication failed",
		RefusedStep:    "NodeStageVolume, wrong CHAP",
		GrowStep:       "grow the LIO LUN",
		GrowTo:         600 << 20,
		Grow: func(_ context.Context, size int64) error {
			tgt.Grow(0, size)
			return nil
		},
		Identify: func(dev string) (string, error) {
			return sysfsIdentity(dev, "device/wwid", "naa.6001405"+serial[:25])
		},
		Detached: func() (string, error) { return noISCSISession(iqn) },
		Restage:  true,
	}
	unstageOnFailure(t, conn, &v)
	if err := steps.New(conn, out).Lifecycle(v); err != nil {
		t.Fatal(err)
	}
}

// noISCSISession checks that no iSCSI session to target iqn is left.
func noISCSISession(iqn string) (string, error) {
	paths, err := filepath.Glob("/sys/class/iscsi_session/session*/targetname")
	if err != nil {
		return "", err
	}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err == nil && strings.TrimSpace(string(b)) == iqn {
			return "", fmt.Errorf("%s to %s still logged in", filepath.Base(filepath.Dir(p)), iqn)
		}
	}
	return "logged out (no session to the target)", nil
}
