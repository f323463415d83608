package vm_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
	"golang.org/x/sys/unix"
)

// TestVMSmoke boots one guest that attaches, formats, mounts, grows and
// detaches a volume from its own NVMe/TCP and iSCSI targets.
func TestVMSmoke(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithTestRun("^TestSmoke"), vm.WithIscsid())
}

// TestVMBootRetry: a guest whose init never starts its tests is killed at
// the boot deadline (half the timeout here) and booted once more, and its
// tests then run. Without the retry this guest hangs until its timeout.
func TestVMBootRetry(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithTestRun("^TestSmokeGuestBasics$"), vm.WithTimeout(50*time.Second), vm.WithHangFirstBoot())
}

func TestSmokeGuestBasics(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getuid() != 0 {
		t.Fatal("in-guest tests run as root")
	}
	if _, err := os.Stat("/usr/bin/berth"); err != nil {
		t.Errorf("berth binary: %v", err)
	}
	for _, p := range []string{"/sys/kernel/config", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			target.LoadModules(t, "loop")
			if _, err := os.Stat(p); err != nil {
				t.Errorf("%s: %v", p, err)
			}
		}
	}
}

func TestSmokeNVMeTCP(t *testing.T) {
	vm.RequireGuest(t)
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}},
		Ports:      []string{"127.0.0.1:4420"},
	})
	ns := tgt.Namespace(1)

	t0 := time.Now()
	ctrl := nvmeConnect(t, tgt.ConnectString("127.0.0.1:4420"))
	dev := waitFor(t, "nvme namespace with uuid "+ns.UUID, func() string {
		return findBlock(`^nvme[0-9]+n[0-9]+$`, "uuid", ns.UUID)
	})
	t.Logf("%s -> /dev/%s in %v", ctrl, dev, time.Since(t0))
	if got, _ := os.ReadFile("/sys/block/" + dev + "/nguid"); strings.TrimSpace(string(got)) != ns.NGUID {
		t.Errorf("nguid = %q, want %q", got, ns.NGUID)
	}
	if got, _ := os.ReadFile("/sys/class/nvme/" + ctrl + "/serial"); strings.TrimSpace(string(got)) != tgt.Serial() {
		t.Errorf("serial = %q, want %q", got, tgt.Serial())
	}
	formatMountGrow(t, "/dev/"+dev, func() { tgt.Grow(1, 128<<20) }, 128<<20, nil)

	mustWriteFile(t, "/sys/class/nvme/"+ctrl+"/delete_controller", "1")
	waitFor(t, "/dev/"+dev+" to go away", func() string {
		if _, err := os.Stat("/sys/block/" + dev); os.IsNotExist(err) {
			return "gone"
		}
		return ""
	})
}

// nvmeConnect connects through /dev/nvme-fabrics and returns the controller
// name ("nvme0"); the controller is deleted when the test ends.
func nvmeConnect(t *testing.T, opts string) string {
	t.Helper()
	f, err := os.OpenFile("/dev/nvme-fabrics", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(opts); err != nil {
		t.Fatalf("connect %s: %v", opts, err)
	}
	buf := make([]byte, 256)
	n, err := f.Read(buf)
	if err != nil {
		t.Fatalf("read /dev/nvme-fabrics: %v", err)
	}
	var ctrl string
	for _, kv := range strings.Split(strings.TrimSpace(string(buf[:n])), ",") {
		if v, ok := strings.CutPrefix(kv, "instance="); ok {
			ctrl = "nvme" + v
		}
	}
	if ctrl == "" {
		t.Fatalf("connect answered %q", buf[:n])
	}
	t.Cleanup(func() {
		os.WriteFile("/sys/class/nvme/"+ctrl+"/delete_controller", []byte("1"), 0o200)
	})
	return ctrl
}

// findBlock returns the block device whose name matches pattern and whose
// sysfs attribute attr (relative to /sys/block/<dev>) contains want.
func findBlock(pattern, attr, want string) string {
	re := regexp.MustCompile(pattern)
	ents, _ := os.ReadDir("/sys/block")
	for _, e := range ents {
		if !re.MatchString(e.Name()) {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), attr))
		if err == nil && strings.Contains(strings.TrimSpace(string(b)), want) {
			return e.Name()
		}
	}
	return ""
}

// waitFor polls cond (test code: the guest has nothing else to do) until it
// returns non-empty or 30 s pass.
func waitFor(t *testing.T, what string, cond func() string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if v := cond(); v != "" {
			return v
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out.String())
	}
	return out.String()
}

func mustWriteFile(t *testing.T, path, v string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(v), 0o200); err != nil {
		t.Fatal(err)
	}
}

func blockSize(t *testing.T, dev string) int64 {
	t.Helper()
	b, err := os.ReadFile("/sys/class/block/" + filepath.Base(dev) + "/size")
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n * 512
}

// formatMountGrow makes ext4 on dev, mounts it, writes a file, grows the
// volume with grow (then rescan, if not nil) to newSize, grows the
// filesystem online and unmounts.
func formatMountGrow(t *testing.T, dev string, grow func(), newSize int64, rescan func()) {
	t.Helper()
	run(t, "/usr/sbin/mkfs.ext4", "-q", "-F", dev)
	mnt := t.TempDir()
	if err := unix.Mount(dev, mnt, "ext4", 0, ""); err != nil {
		t.Fatalf("mount %s: %v", dev, err)
	}
	mounted := true
	defer func() {
		if mounted {
			unix.Unmount(mnt, 0)
		}
	}()
	data := bytes.Repeat([]byte("berth"), 1<<16)
	if err := os.WriteFile(filepath.Join(mnt, "data"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	var before syscall.Statfs_t
	if err := syscall.Statfs(mnt, &before); err != nil {
		t.Fatal(err)
	}

	grow()
	if rescan != nil {
		rescan()
	}
	waitFor(t, fmt.Sprintf("%s to grow to %d bytes", dev, newSize), func() string {
		if blockSize(t, dev) == newSize {
			return "ok"
		}
		return ""
	})
	run(t, "/usr/sbin/resize2fs", dev)
	var after syscall.Statfs_t
	if err := syscall.Statfs(mnt, &after); err != nil {
		t.Fatal(err)
	}
	if after.Blocks*uint64(after.Bsize) <= before.Blocks*uint64(before.Bsize) {
		t.Errorf("filesystem did not grow: %d -> %d blocks", before.Blocks, after.Blocks)
	}
	got, err := os.ReadFile(filepath.Join(mnt, "data"))
	if err != nil || !bytes.Equal(got, data) {
		t.Errorf("data after grow: %v (equal %v)", err, bytes.Equal(got, data))
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatalf("unmount: %v", err)
	}
	mounted = false
}

func TestSmokeISCSI(t *testing.T) {
	vm.RequireGuest(t)
	target.StartIscsid(t)
	tgt := target.NewISCSITarget(t, target.ISCSIConfig{})
	lun := tgt.LUN(0)
	portal := tgt.Portals()[0]

	t0 := time.Now()
	iscsiLogin(t, tgt.IQN(), portal, nil)
	dev := waitFor(t, "SCSI disk with serial "+lun.Serial, func() string {
		return findBlock(`^sd[a-z]+$`, "device/vpd_pg80", lun.Serial)
	})
	wwid, _ := os.ReadFile("/sys/block/" + dev + "/device/wwid")
	t.Logf("login -> /dev/%s (wwid %s) in %v", dev, strings.TrimSpace(string(wwid)), time.Since(t0))

	formatMountGrow(t, "/dev/"+dev, func() { tgt.Grow(0, 128<<20) }, 128<<20, func() {
		mustWriteFile(t, "/sys/block/"+dev+"/device/rescan", "1")
	})
	run(t, "iscsiadm", "-m", "node", "-T", tgt.IQN(), "-p", portal, "--logout")
	waitFor(t, "/dev/"+dev+" to go away", func() string {
		if _, err := os.Stat("/sys/block/" + dev); os.IsNotExist(err) {
			return "gone"
		}
		return ""
	})
}

func TestSmokeISCSIMutualCHAP(t *testing.T) {
	vm.RequireGuest(t)
	target.StartIscsid(t)
	chap := &target.CHAP{User: "berth-in", Password: "secret-in-0123", MutualUser: "berth-out", MutualPassword: "secret-out-012"}
	tgt := target.NewISCSITarget(t, target.ISCSIConfig{
		Portals:    []string{"127.0.0.1:3261"},
		Initiators: []target.ISCSIInitiator{{IQN: target.InitiatorName(t), CHAP: chap}},
	})
	portal := tgt.Portals()[0]

	bad := *chap
	bad.Password = "wrong-secret-0"
	if err := iscsiLoginErr(t, tgt.IQN(), portal, &bad); err == nil {
		t.Fatal("login with a wrong CHAP secret succeeded")
	}
	iscsiLogin(t, tgt.IQN(), portal, chap)
	lun := tgt.LUN(0)
	dev := waitFor(t, "SCSI disk with serial "+lun.Serial, func() string {
		return findBlock(`^sd[a-z]+$`, "device/vpd_pg80", lun.Serial)
	})
	t.Logf("mutual CHAP login -> /dev/%s", dev)
}

// iscsiLogin creates a node record and logs in; it logs out and deletes the
// record when the test ends.
func iscsiLogin(t *testing.T, iqn, portal string, chap *target.CHAP) {
	t.Helper()
	if err := iscsiLoginErr(t, iqn, portal, chap); err != nil {
		t.Fatal(err)
	}
}

func iscsiLoginErr(t *testing.T, iqn, portal string, chap *target.CHAP) error {
	t.Helper()
	node := []string{"-m", "node", "-T", iqn, "-p", portal}
	run(t, "iscsiadm", append(node, "-o", "new")...)
	t.Cleanup(func() {
		exec.Command("iscsiadm", append(node, "--logout")...).Run()
		exec.Command("iscsiadm", append(node, "-o", "delete")...).Run()
	})
	if chap != nil {
		for _, kv := range [][2]string{
			{"node.session.auth.authmethod", "CHAP"},
			{"node.session.auth.username", chap.User},
			{"node.session.auth.password", chap.Password},
			{"node.session.auth.username_in", chap.MutualUser},
			{"node.session.auth.password_in", chap.MutualPassword},
		} {
			run(t, "iscsiadm", append(node, "-o", "update", "-n", kv[0], "-v", kv[1])...)
		}
	}
	out, err := exec.Command("iscsiadm", append(node, "--login")...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iscsiadm login %s %s: %v: %s", iqn, portal, err, out)
	}
	return nil
}

const twoVMsNQN = "nqn.2014-08.io.berth:two-vms"

// TestVMTwoVMs boots a target guest and an initiator guest on a private
// link; the initiator connects over NVMe/TCP, then the target guest is
// killed and the initiator must see its path go down.
func TestVMTwoVMs(t *testing.T) {
	t.Parallel()
	link := vm.NewLink(t)
	tgt := vm.Boot(t, vm.WithName("target"), vm.WithTestRun("^TestTwoVMsTarget$"),
		vm.WithNIC(link, "192.168.77.1/24"))
	tgt.WaitSignal("target-ready", 3*time.Minute)
	ini := vm.Boot(t, vm.WithName("initiator"), vm.WithTestRun("^TestTwoVMsInitiator$"),
		vm.WithNIC(link, "192.168.77.2/24"))
	ini.WaitSignal("connected", 3*time.Minute)
	tgt.Kill()
	ini.ReportTests(t)
}

func TestTwoVMsTarget(t *testing.T) {
	vm.RequireGuest(t)
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: twoVMsNQN, Ports: []string{"192.168.77.1:4420"}})
	vm.SignalHost("target-ready")
	vm.WaitHost(t, "stop") // until the host kills this guest
}

func TestTwoVMsInitiator(t *testing.T) {
	vm.RequireGuest(t)
	target.LoadModules(t, "nvme_tcp")
	ctrl := nvmeConnect(t, "transport=tcp,traddr=192.168.77.1,trsvcid=4420,nqn="+twoVMsNQN+
		",keep_alive_tmo=2,reconnect_delay=1,ctrl_loss_tmo=60")
	dev := waitFor(t, "a namespace of "+ctrl, func() string {
		return findBlock(`^nvme[0-9]+n[0-9]+$`, "device/subsysnqn", twoVMsNQN)
	})
	if err := writeSync("/dev/"+dev, []byte("across the link")); err != nil {
		t.Fatalf("write %s: %v", dev, err)
	}
	state := func() string {
		b, _ := os.ReadFile("/sys/class/nvme/" + ctrl + "/state")
		return strings.TrimSpace(string(b))
	}
	if s := state(); s != "live" {
		t.Fatalf("%s state %q before the target went away", ctrl, s)
	}
	t0 := time.Now()
	vm.SignalHost("connected")
	waitFor(t, ctrl+" to leave the live state", func() string {
		if s := state(); s != "live" {
			return s
		}
		return ""
	})
	t.Logf("%s: %s %v after the target guest was killed", ctrl, state(), time.Since(t0))
}

// TestVMSystemd boots the Debian root with systemd as PID 1.
func TestVMSystemd(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithTestRun("^TestSystemdGuest"), vm.WithSystemd(), vm.WithIscsid(), vm.WithTimeout(8*time.Minute))
}

func TestSystemdGuest(t *testing.T) {
	vm.RequireGuest(t)
	comm, err := os.ReadFile("/proc/1/comm")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(comm)); got != "systemd" {
		t.Fatalf("PID 1 is %q, want systemd", got)
	}
	out, _ := exec.Command("systemctl", "is-system-running", "--wait").CombinedOutput()
	t.Logf("system state: %s", strings.TrimSpace(string(out)))
	t.Logf("%s", run(t, "systemd-analyze"))
	if _, err := os.Stat("/run/udev/control"); err != nil {
		t.Errorf("systemd-udevd is not running: %v", err)
	}
	if out, err := exec.Command("systemctl", "is-active", "iscsid.service").CombinedOutput(); err != nil {
		t.Errorf("iscsid.service (WithIscsid): %v: %s", err, out)
	}
}

// TestVMMultipath checks the udev and multipathd guest options: two iSCSI
// paths to one LUN become one dm-multipath map that survives losing a path.
func TestVMMultipath(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithTestRun("^TestMultipathGuest"), vm.WithIscsid(), vm.WithMultipathd())
}

func TestMultipathGuest(t *testing.T) {
	vm.RequireGuest(t)
	if _, err := os.Stat("/dev/disk/by-id"); err != nil {
		// udev made no links yet for virtual disks: only check that it runs.
		if _, err := os.Stat("/run/udev/control"); err != nil {
			t.Fatalf("systemd-udevd is not running: %v", err)
		}
	}
	tgt := target.NewISCSITarget(t, target.ISCSIConfig{Portals: []string{"127.0.0.1:3260", "127.0.0.2:3260"}})
	lun := tgt.LUN(0)
	for _, p := range tgt.Portals() {
		iscsiLogin(t, tgt.IQN(), p, nil)
	}
	var paths []string
	waitFor(t, "two SCSI paths with serial "+lun.Serial, func() string {
		paths = nil
		ents, _ := os.ReadDir("/sys/block")
		for _, e := range ents {
			if b, err := os.ReadFile("/sys/block/" + e.Name() + "/device/vpd_pg80"); err == nil &&
				strings.HasPrefix(e.Name(), "sd") && bytes.Contains(b, []byte(lun.Serial)) {
				paths = append(paths, e.Name())
			}
		}
		if len(paths) == 2 {
			return "ok"
		}
		return ""
	})
	t.Cleanup(func() {
		if t.Failed() {
			for _, c := range [][]string{{"multipathd", "show", "paths"}, {"multipath", "-v3", "-d"}, {"udevadm", "info", "/dev/" + paths[0]}} {
				out, err := exec.Command(c[0], c[1:]...).CombinedOutput()
				t.Logf("%s: %v\n%s", strings.Join(c, " "), err, out)
			}
		}
	})
	dm := waitFor(t, "a multipath map over both of "+strings.Join(paths, ","), func() string {
		holders, _ := os.ReadDir("/sys/block/" + paths[0] + "/holders")
		for _, h := range holders {
			uuid, _ := os.ReadFile("/sys/block/" + h.Name() + "/dm/uuid")
			slaves, _ := os.ReadDir("/sys/block/" + h.Name() + "/slaves")
			if strings.HasPrefix(string(uuid), "mpath-") && len(slaves) == 2 {
				return h.Name()
			}
		}
		return ""
	})
	t.Cleanup(func() {
		exec.Command("multipath", "-f", "/dev/"+dm).Run()
	})
	t.Logf("paths %v -> %s", paths, dm)

	lost, err := filepath.EvalSymlinks("/dev/disk/by-path/ip-127.0.0.2:3260-iscsi-" + tgt.IQN() + "-lun-0")
	if err != nil {
		t.Fatalf("udev by-path link: %v", err)
	}
	lost = filepath.Base(lost)
	tgt.RemovePortal("127.0.0.2:3260")
	waitFor(t, "multipathd to fail path "+lost, func() string {
		out, _ := exec.Command("multipathd", "show", "paths", "format", "%d %t %T").Output()
		for _, l := range strings.Split(string(out), "\n") {
			if f := strings.Fields(l); len(f) == 3 && f[0] == lost && (f[1] == "failed" || f[2] == "faulty") {
				return l
			}
		}
		return ""
	})
	if err := writeSync("/dev/"+dm, []byte("one path left")); err != nil {
		t.Fatalf("write through %s with one path left: %v", dm, err)
	}
	t.Log(run(t, "multipath", "-ll"))
}

// writeSync writes data at the start of a block device and flushes it to the
// device.
func writeSync(dev string, data []byte) error {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.WriteAt(data, 0); err != nil {
		return err
	}
	return f.Sync()
}

// TestVMKernelBugRerun: a guest whose kernel oopses in a known kernel bug
// while its tests run is killed and run once more. The first boot's test
// logs such an oops and then waits; without the rerun the guest hangs
// until its timeout.
func TestVMKernelBugRerun(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithTestRun("^TestSmokeGuestKernelBugRerun$"), vm.WithTimeout(60*time.Second), vm.WithFakeOopsFirstBoot())
}

func TestSmokeGuestKernelBugRerun(t *testing.T) {
	vm.RequireGuest(t)
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(strings.Fields(string(cmdline)), vm.FakeOopsArg) {
		return
	}
	for _, l := range []string{
		"<1>BUG: kernel NULL pointer dereference, address: 0000000000000030",
		"<1>RIP: 0010:iscsi_sw_tcp_release_conn+0x67/0x90 [iscsi_tcp]",
		"<4>Call Trace:",
		"<4>---[ end trace 0000000000000000 ]---",
	} {
		mustWriteFile(t, "/dev/kmsg", l)
	}
	time.Sleep(time.Hour) // until the host kills the guest
}
