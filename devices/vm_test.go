//go:build linux

package devices

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs"
	"github.com/berth-csi/berth/test/vm"
)

var guestModules = []string{"loop", "nvmet", "nvmet_tcp", "nvme_tcp", "iscsi_tcp",
	"target_core_mod", "target_core_iblock", "iscsi_target_mod"}

// TestVMDevices runs the in-guest tests: an nvmet namespace and a LIO LUN
// appear and are matched by identity, a wrong WWID is refused, with the
// kernel's events only and again with systemd-udevd (where the loop tests
// run too), and a multipath map over two iSCSI portals is found.
func TestVMDevices(t *testing.T) {
	t.Run("kernel-events", func(t *testing.T) {
		vm.RunGuestTests(t, vm.WithTestRun("^TestGuest(NVMe|SCSI)"),
			vm.WithModules(guestModules...), vm.WithIscsid(), vm.WithTimeout(5*time.Minute))
	})
	t.Run("udev", func(t *testing.T) {
		vm.RunGuestTests(t, vm.WithTestRun("^(TestGuest(NVMe|SCSI|UdevMessage|UdevWatchPR)|TestLoop|TestWaitersAroundAttach|TestManyConcurrentWaiters|TestVerifyDetects|TestOverflowRescan)"),
			vm.WithModules(guestModules...), vm.WithIscsid(), vm.WithUdev(), vm.WithTimeout(6*time.Minute))
	})
	t.Run("multipath", func(t *testing.T) {
		// multipathd is started by the in-guest test itself, with only the
		// modules it needs.
		vm.RunGuestTests(t, vm.WithTestRun("^TestGuestMultipath"),
			vm.WithModules(append(guestModules, "dm_multipath", "dm_service_time", "dm_round_robin")...),
			vm.WithIscsid(), vm.WithUdev(), vm.WithTimeout(5*time.Minute))
	})
}

// TestVMBenchDevices measures, in a guest, the time from the action that
// creates a device (the write to /dev/nvme-fabrics, the iSCSI login) to a
// verified Device, next to the kernel's uevent. Runs with BERTH_BENCH=1.
func TestVMBenchDevices(t *testing.T) {
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1 (make bench)")
	}
	for _, udev := range []bool{false, true} {
		name := "kernel-events"
		opts := []vm.Option{vm.WithTestRun("^TestGuestBench"), vm.WithModules(guestModules...), vm.WithIscsid(),
			vm.WithTimeout(8 * time.Minute), vm.WithEnv(map[string]string{"BERTH_BENCH": "1"})}
		if udev {
			name = "udev"
			opts = append(opts, vm.WithUdev())
		}
		t.Run(name, func(t *testing.T) { vm.RunGuestTests(t, opts...) })
	}
}

// ---- in-guest helpers ----

// benchCtx bounds a whole benchmark (every round) in the guest.
func benchCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func guestCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func cfs(t *testing.T, path, value string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
		t.Fatalf("write %q to %s: %v", value, path, err)
	}
}

func mkdir(t *testing.T, path string) {
	t.Helper()
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatalf("mkdir %s: %v", path, err)
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// backingLoop attaches a sparse tmpfs file through the package itself.
func backingLoop(t *testing.T, l *Listener, size int64) *Device {
	t.Helper()
	f := testFile(t, t.TempDir(), "backing.img", size)
	d, err := AttachLoop(guestCtx(t), l, f, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { DetachLoop(d) })
	return d
}

func guestListener(t *testing.T, opts ...ListenerOption) *Listener {
	t.Helper()
	l := newTestListener(t, opts...)
	_, err := os.Stat("/run/udev/control")
	if l.Udev() != (err == nil) {
		t.Fatalf("listener udev mode %v, /run/udev/control: %v", l.Udev(), err)
	}
	t.Logf("listener: udev=%v", l.Udev())
	return l
}

// checkReady asserts what Wait promises about udev: its database has the
// device when udevd runs.
func checkReady(t *testing.T, l *Listener, d *Device) {
	t.Helper()
	if l.Udev() && !l.Roots().udevInitialized(d.Major, d.Minor) {
		t.Errorf("%s returned before udev initialised it", d)
	}
	if err := d.Verify(); err != nil {
		t.Errorf("Verify: %v", err)
	}
}

type nvmet struct {
	nqn, sub, port string
}

const nvmetRoot = "/sys/kernel/config/nvmet"

func newNVMet(t *testing.T, nqn string, portID int, dev *Device, uuid, nguid string) *nvmet {
	t.Helper()
	n := &nvmet{nqn: nqn, sub: filepath.Join(nvmetRoot, "subsystems", nqn), port: filepath.Join(nvmetRoot, "ports", strconv.Itoa(portID))}
	mkdir(t, n.sub)
	t.Cleanup(func() { os.Remove(n.sub) })
	cfs(t, n.sub+"/attr_allow_any_host", "1")
	ns := n.sub + "/namespaces/1"
	mkdir(t, ns)
	t.Cleanup(func() { os.WriteFile(ns+"/enable", []byte("0"), 0); os.Remove(ns) })
	cfs(t, ns+"/device_path", dev.Path)
	cfs(t, ns+"/device_uuid", uuid)
	cfs(t, ns+"/device_nguid", nguid)
	cfs(t, ns+"/enable", "1")
	mkdir(t, n.port)
	t.Cleanup(func() { os.Remove(n.port) })
	cfs(t, n.port+"/addr_trtype", "tcp")
	cfs(t, n.port+"/addr_adrfam", "ipv4")
	cfs(t, n.port+"/addr_traddr", "127.0.0.1")
	cfs(t, n.port+"/addr_trsvcid", strconv.Itoa(4420+portID))
	link := n.port + "/subsystems/" + nqn
	if err := os.Symlink(n.sub, link); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(link) })
	return n
}

// connect writes the connect string to /dev/nvme-fabrics and returns the
// controller name; it is deleted when the test ends.
func (n *nvmet) connect(t *testing.T) string {
	t.Helper()
	f, err := os.OpenFile("/dev/nvme-fabrics", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	port, _ := strconv.Atoi(filepath.Base(n.port))
	opts := fmt.Sprintf("transport=tcp,traddr=127.0.0.1,trsvcid=%d,nqn=%s", 4420+port, n.nqn)
	if _, err := f.WriteString(opts); err != nil {
		t.Fatalf("connect %s: %v", opts, err)
	}
	buf := make([]byte, 128)
	k, err := f.Read(buf)
	if err != nil {
		t.Fatalf("read /dev/nvme-fabrics: %v", err)
	}
	m := regexp.MustCompile(`instance=(\d+)`).FindStringSubmatch(string(buf[:k]))
	if m == nil {
		t.Fatalf("connect answered %q", buf[:k])
	}
	ctrl := "nvme" + m[1]
	t.Cleanup(func() { os.WriteFile("/sys/class/nvme/"+ctrl+"/delete_controller", []byte("1"), 0) })
	return ctrl
}

const (
	nvmeUUID  = "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c"
	nvmeNGUID = "00112233-4455-6677-8899-aabbccddeeff"
)

func TestGuestNVMeMatch(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestCtx(t)
	l := guestListener(t)
	nqn := "nqn.2026-01.io.berth:devices-nvme"
	n := newNVMet(t, nqn, 1, backingLoop(t, l, 32<<20), nvmeUUID, nvmeNGUID)

	right := l.Subscribe(MatchNVMe(nqn, 1, strings.ToUpper(nvmeUUID), nvmeNGUID))
	defer right.Close()
	wrong := l.Subscribe(MatchNVMe(nqn, 1, "", "00112233-4455-6677-8899-aabbccddeef0"))
	defer wrong.Close()
	start := time.Now()
	ctrl := n.connect(t)
	d, err := right.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tr := right.Trace()
	t.Logf("%s via %s: found %v after the connect write (kernel event after %v, udev event after %v, from scan %v)",
		d, ctrl, tr.Found.Sub(start), sinceOrZero(tr.KernelEvent.Received, start), sinceOrZero(tr.UdevEvent.Received, start), tr.FromScan)
	if d.ID.Kind != KindNVMe || d.ID.NQN != nqn || d.ID.NSID != 1 || d.ID.UUID != nvmeUUID || normHexID(d.ID.NGUID) != normHexID(nvmeNGUID) || d.Size != 32<<20 {
		t.Errorf("device %+v identity %+v", d, d.ID)
	}
	// The multipath head sits under the subsystem, not the controller.
	if real, err := filepath.EvalSymlinks("/sys/class/block/" + d.Name); err == nil {
		t.Logf("%s is %s", d.Name, real)
	}
	checkReady(t, l, d)

	// A namespace with another NGUID is never taken for this one.
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if got, err := wrong.Wait(wctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("mismatching NGUID: %v %v, want a timeout", got, err)
	}
	// A Device whose expected identity differs fails Verify.
	other := *d
	other.ID.NGUID = "00112233445566778899aabbccddeef0"
	if err := other.Verify(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Verify with another NGUID: %v", err)
	}

	// Disconnecting removes the namespace; a removal waiter sees it.
	gone := l.subscribeRemoval(d)
	defer gone.Close()
	cfs(t, "/sys/class/nvme/"+ctrl+"/delete_controller", "1")
	if _, err := gone.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Verify(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Verify after disconnect: %v", err)
	}
}

func sinceOrZero(t, start time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return t.Sub(start)
}

// lio is an iSCSI target in LIO with one LUN.
type lio struct {
	iqn, serial string
	portals     []string
}

const lioRoot = "/sys/kernel/config/target"

func newLIO(t *testing.T, name string, dev *Device, serial string, portals ...string) *lio {
	t.Helper()
	tg := &lio{iqn: "iqn.2026-01.io.berth:" + name, serial: serial, portals: portals}
	so := filepath.Join(lioRoot, "core", "iblock_0", name)
	if err := os.MkdirAll(so, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(so) })
	cfs(t, so+"/control", "udev_path="+dev.Path)
	cfs(t, so+"/wwn/vpd_unit_serial", serial)
	cfs(t, so+"/enable", "1")
	tpg := filepath.Join(lioRoot, "iscsi", tg.iqn, "tpgt_1")
	if err := os.MkdirAll(tpg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(tpg+"/enable", []byte("0"), 0)
		for _, p := range portals {
			os.Remove(tpg + "/np/" + p)
		}
		os.Remove(tpg + "/lun/lun_0/" + name)
		os.Remove(tpg + "/lun/lun_0")
		os.Remove(tpg)
		os.Remove(filepath.Dir(tpg))
	})
	mkdir(t, tpg+"/lun/lun_0")
	if err := os.Symlink(so, tpg+"/lun/lun_0/"+name); err != nil {
		t.Fatal(err)
	}
	for _, p := range portals {
		mkdir(t, tpg+"/np/"+p)
	}
	for attr, v := range map[string]string{"generate_node_acls": "1", "authentication": "0", "demo_mode_write_protect": "0", "cache_dynamic_acls": "1"} {
		cfs(t, tpg+"/attrib/"+attr, v)
	}
	cfs(t, tpg+"/enable", "1")
	return tg
}

// wwid is the NAA 6 identifier LIO derives from the unit serial.
func (tg *lio) wwid() string {
	hex := strings.Map(func(r rune) rune {
		if strings.ContainsRune("0123456789abcdef", r) {
			return r
		}
		return -1
	}, strings.ToLower(tg.serial))
	return "naa.6001405" + hex[:25]
}

// login logs in through portal and scans the session's host for LUNs (the
// image's open-iscsi does not scan by itself).
func (tg *lio) login(t *testing.T, portal string) {
	t.Helper()
	run(t, "iscsiadm", "-m", "discovery", "-t", "sendtargets", "-p", portal)
	run(t, "iscsiadm", "-m", "node", "-T", tg.iqn, "-p", portal, "--login")
	t.Cleanup(func() {
		exec.Command("iscsiadm", "-m", "node", "-T", tg.iqn, "-p", portal, "--logout").Run()
		exec.Command("iscsiadm", "-m", "node", "-T", tg.iqn, "-p", portal, "-o", "delete").Run()
	})
	sessions, _ := filepath.Glob("/sys/class/iscsi_session/session*")
	for _, s := range sessions {
		name, _ := readAttr(s, "targetname")
		addr, _ := readAttr(filepath.Join(s, "device", "connection"+strings.TrimPrefix(filepath.Base(s), "session")+":0", "iscsi_connection", "connection"+strings.TrimPrefix(filepath.Base(s), "session")+":0"), "persistent_address")
		real, err := filepath.EvalSymlinks(s)
		if name != tg.iqn || err != nil {
			continue
		}
		m := regexp.MustCompile(`/host(\d+)/`).FindStringSubmatch(real)
		if m == nil {
			t.Fatalf("no SCSI host in %s", real)
		}
		if addr != "" && !strings.HasPrefix(portal, addr+":") {
			continue
		}
		cfs(t, "/sys/class/scsi_host/host"+m[1]+"/scan", "- - -")
	}
}

func TestGuestSCSIMatch(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestCtx(t)
	l := guestListener(t)
	tg := newLIO(t, "devscsi", backingLoop(t, l, 64<<20), "a1b2c3d4-e5f6-0718-293a-4b5c6d7e8f90", "127.0.0.1:3260")

	w := l.Subscribe(MatchSCSI("", tg.wwid()))
	defer w.Close()
	wrong := l.Subscribe(MatchSCSI("", "naa.6001405ffffffffffffffffffffffffff"))
	defer wrong.Close()
	start := time.Now()
	tg.login(t, "127.0.0.1:3260")
	d, err := w.Wait(ctx)
	if err != nil {
		logSCSIDisks(t)
		t.Fatal(err)
	}
	tr := w.Trace()
	t.Logf("%s found %v after the login began (login returned, kernel event after %v, udev event after %v, from scan %v)",
		d, tr.Found.Sub(start), sinceOrZero(tr.KernelEvent.Received, start), sinceOrZero(tr.UdevEvent.Received, start), tr.FromScan)
	if d.ID.Kind != KindSCSI || d.ID.WWID != tg.wwid() || !regexp.MustCompile(`^\d+:0:0:0$`).MatchString(d.ID.HCTL) || d.Size != 64<<20 {
		t.Errorf("device %+v identity %+v", d, d.ID)
	}
	// The kernel's wwid and our VPD 0x83 parser agree.
	page, err := os.ReadFile("/sys/block/" + d.Name + "/device/vpd_pg83")
	if err != nil {
		t.Fatal(err)
	}
	ds, err := ParseVPD83(page)
	if err != nil || PreferredWWID(ds) != d.ID.WWID {
		t.Errorf("vpd_pg83 gives %q (%v), kernel wwid %q", PreferredWWID(ds), err, d.ID.WWID)
	}
	if os.Getenv("BERTH_SAVE_SAMPLES") != "" {
		t.Logf("vpd_pg83 of %s: %x", d.Name, page)
	}
	checkReady(t, l, d)
	// Matching by address and the udev form of the WWID finds the same disk.
	byAddr := l.Subscribe(MatchSCSI(d.ID.HCTL, "3"+strings.TrimPrefix(tg.wwid(), "naa.")))
	if d2, err := byAddr.Wait(ctx); err != nil || d2.Name != d.Name {
		t.Errorf("by address: %v %v", d2, err)
	}
	byAddr.Close()

	// WWID mismatch: never matched, and Verify of a device expected with
	// another WWID is refused.
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if got, err := wrong.Wait(wctx); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "WWID") {
		t.Errorf("mismatching WWID: %v %v, want a timeout naming the WWID", got, err)
	}
	other := *d
	other.ID.WWID = "naa.6001405ffffffffffffffffffffffffff"
	if err := other.Verify(); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), d.ID.WWID) {
		t.Errorf("Verify with another WWID: %v", err)
	}

	if err := RemoveSCSIDevice(ctx, l, d); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/sys/block/" + d.Name); err == nil {
		t.Errorf("%s still exists", d.Name)
	}
	if err := RemoveSCSIDevice(ctx, l, d); err != nil {
		t.Errorf("second removal: %v", err)
	}
}

func logSCSIDisks(t *testing.T) {
	Roots{}.scanBlock(KindSCSI, nil, func(d *Device) bool {
		t.Logf("SCSI disk %s: %+v designators %q", d.Name, d.ID, d.designators)
		return false
	})
}

// loginPaths logs in to every portal of tg and returns the disks that
// appeared, found by WWID through the listener.
func loginPaths(t *testing.T, ctx context.Context, l *Listener, tg *lio) map[string]*Device {
	t.Helper()
	paths := map[string]*Device{}
	for _, p := range tg.portals {
		w := l.Subscribe(notIn{MatchSCSI("", tg.wwid()), paths})
		tg.login(t, p)
		d, err := w.Wait(ctx)
		w.Close()
		if err != nil {
			logSCSIDisks(t)
			t.Fatalf("path through %s: %v", p, err)
		}
		paths[d.Name] = d
	}
	return paths
}

// checkMap checks the map's view of its paths and removes the map, then
// its paths.
func checkMap(t *testing.T, ctx context.Context, l *Listener, dm *Device, paths map[string]*Device) {
	t.Helper()
	checkReady(t, l, dm)
	var names []string
	for name := range paths {
		names = append(names, name)
		m, err := Roots{}.MultipathMap(name)
		if err != nil || m.Name != dm.Name {
			t.Errorf("MultipathMap(%s) = %v %v, want %s", name, m, err, dm.Name)
		}
	}
	sort.Strings(names)
	slaves, err := Roots{}.Slaves(dm.Name)
	if sort.Strings(slaves); err != nil || strings.Join(slaves, ",") != strings.Join(names, ",") {
		t.Errorf("slaves %v %v, want %v", slaves, err, names)
	}
	ps, err := MultipathPaths(dm)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("paths: %+v", ps)
	if len(ps) != len(paths) {
		t.Fatalf("%d paths, want %d", len(ps), len(paths))
	}
	for _, p := range ps {
		if !p.Active || p.SCSIState != "running" || paths[p.Name] == nil {
			t.Errorf("path %+v", p)
		}
	}
	// A path cannot be removed under its map.
	if err := RemoveSCSIDevice(ctx, l, paths[names[0]]); !errors.Is(err, errdefs.ErrBusy) {
		t.Errorf("RemoveSCSIDevice(%s) under a map: %v, want ErrBusy", names[0], err)
	}
	if err := RemoveMultipathMap(ctx, l, dm); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/sys/block/" + dm.Name); err == nil {
		t.Errorf("%s still exists", dm.Name)
	}
	if err := RemoveMultipathMap(ctx, l, dm); err != nil {
		t.Errorf("second map removal: %v", err)
	}
	for _, p := range paths {
		if err := RemoveSCSIDevice(ctx, l, p); err != nil {
			t.Errorf("RemoveSCSIDevice(%s): %v", p.Name, err)
		}
	}
}

// TestGuestMultipathMap builds the map over two iSCSI paths itself, the way
// multipathd does (uuid "mpath-<WWID>", created, loaded, resumed), so the
// package's side is tested whatever multipathd does: the map is found by its
// events once it is live, its paths and their states are read through
// DM_TABLE_STATUS, a failed path shows, and the map is removed by ioctls.
func TestGuestMultipathMap(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestCtx(t)
	l := guestListener(t)
	tg := newLIO(t, "devmap", backingLoop(t, l, 64<<20), "1a2b3c4d-5e6f-7081-92a3-b4c5d6e7f809", "127.0.0.1:3260", "127.0.0.2:3260")
	paths := loginPaths(t, ctx, l, tg)
	var devs []string
	for _, p := range paths {
		devs = append(devs, fmt.Sprintf("%d:%d 1000", p.Major, p.Minor))
	}
	sort.Strings(devs)
	uuid := "mpath-3" + strings.TrimPrefix(tg.wwid(), "naa.")
	table := fmt.Sprintf("0 %d multipath 0 0 1 1 round-robin 0 %d 1 %s", (64<<20)/512, len(devs), strings.Join(devs, " "))

	mp := l.Subscribe(MatchMultipath(tg.wwid()))
	defer mp.Close()
	run(t, "dmsetup", "create", "--noudevsync", "mpathtest", "-u", uuid, "--table", table)
	t.Cleanup(func() { exec.Command("dmsetup", "remove", "--noudevsync", "mpathtest").Run() })
	dm, err := mp.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if dm.ID.WWID != uuid || dm.ID.DMName != "mpathtest" || dm.Size != 64<<20 {
		t.Errorf("map %+v identity %+v", dm, dm.ID)
	}
	// Fail one path in the map: the status shows it.
	first := strings.Fields(devs[0])[0]
	run(t, "dmsetup", "message", "mpathtest", "0", "fail_path", first)
	ps, err := MultipathPaths(dm)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		dev := fmt.Sprintf("%d:%d", p.Major, p.Minor)
		if (dev == first) == p.Active || (dev == first && p.FailCount != 1) {
			t.Errorf("after fail_path %s: %+v", first, p)
		}
	}
	run(t, "dmsetup", "message", "mpathtest", "0", "reinstate_path", first)
	checkMap(t, ctx, l, dm, paths)
}

// TestGuestMultipathd has multipathd assemble the map over two portals.
func TestGuestMultipathd(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestCtx(t)
	l := guestListener(t)
	if !l.Udev() {
		t.Fatal("multipathd guests run udevd")
	}
	var daemonLog bytes.Buffer
	if exec.Command("multipathd", "show", "daemon").Run() != nil {
		// In the foreground, so its log lands in the test's.
		cmd := exec.Command("multipathd", "-d", "-s", "-v2")
		cmd.Stdout, cmd.Stderr = &daemonLog, &daemonLog
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			exec.Command("multipathd", "shutdown").Run()
			cmd.Process.Kill()
			cmd.Wait()
		})
	}
	tg := newLIO(t, "devmpath", backingLoop(t, l, 64<<20), "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "127.0.0.1:3260", "127.0.0.2:3260")
	paths := loginPaths(t, ctx, l, tg)
	var names []string
	for n := range paths {
		names = append(names, n)
	}
	// multipathd builds the map over the first path and adds the second by
	// a reload: wait for the map over both.
	mp := l.Subscribe(MatchMultipath(tg.wwid(), names...))
	defer mp.Close()
	start := time.Now()
	dm, err := mp.Wait(ctx)
	if err != nil {
		for _, c := range [][]string{{"multipathd", "show", "paths"}, {"multipathd", "show", "maps"}, {"dmsetup", "table"}} {
			out, cerr := exec.Command(c[0], c[1:]...).CombinedOutput()
			t.Logf("%s: %v\n%s", strings.Join(c, " "), cerr, out)
		}
		t.Logf("multipathd log:\n%s", daemonLog.String())
		t.Fatal(err)
	}
	t.Logf("map %s (%s, %s) found %v after the second path", dm, dm.ID.DMName, dm.ID.WWID, time.Since(start))
	// A reload shows both slaves in sysfs when multipathd loads the new
	// table, a moment before it resumes the map with it: the live table's
	// paths follow within the reload.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ps, err := MultipathPaths(dm)
		if err == nil && len(ps) == len(paths) || time.Now().After(deadline) {
			break
		}
	}
	checkMap(t, ctx, l, dm, paths)
}

// notIn matches what m matches, except the devices already found.
type notIn struct {
	m    Matcher
	seen map[string]*Device
}

func (n notIn) Match(d *Device) bool { return n.m.Match(d) && n.seen[d.Name] == nil }
func (n notIn) String() string       { return n.m.String() + " (another path)" }

// latencies collects durations for the benchmark report.
type latencies map[string][]time.Duration

func (l latencies) add(name string, d time.Duration) { l[name] = append(l[name], d) }

func (l latencies) report(t *testing.T, what string) {
	names := make([]string, 0, len(l))
	for n := range l {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		ds := l[n]
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		t.Logf("BENCH devices %-28s %-36s n=%-3d p50=%-10v max=%v", what, n, len(ds),
			ds[len(ds)/2].Round(time.Microsecond), ds[len(ds)-1].Round(time.Microsecond))
	}
}

const benchRounds = 10

func benchMode(l *Listener) string {
	if l.Udev() {
		return "(udev)"
	}
	return "(kernel events)"
}

// eventLog records every uevent the listener receives, for the timeline
// of a benchmark round.
type eventLog struct {
	mu  sync.Mutex
	evs []EventInfo
}

func (e *eventLog) hook(ev EventInfo) {
	e.mu.Lock()
	e.evs = append(e.evs, ev)
	e.mu.Unlock()
}

// since returns the events received at or after t.
func (e *eventLog) since(t time.Time) []EventInfo {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []EventInfo
	for _, ev := range e.evs {
		if !ev.Received.Before(t) {
			out = append(out, ev)
		}
	}
	return out
}

// TestGuestBenchNVMe: the connect write to /dev/nvme-fabrics, then a
// verified namespace device, benchRounds times. The first rounds log a
// timeline of every uevent received, relative to the connect write.
func TestGuestBenchNVMe(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark")
	}
	ctx := benchCtx(t)
	var evlog eventLog
	l := guestListener(t, WithEventHook(evlog.hook))
	nqn := "nqn.2026-01.io.berth:devices-bench"
	n := newNVMet(t, nqn, 2, backingLoop(t, l, 16<<20), nvmeUUID, nvmeNGUID)
	lat, attrLat := latencies{}, attrLatencies{}
	for round := range benchRounds {
		w := l.Subscribe(MatchNVMe(nqn, 1, nvmeUUID, ""))
		start := time.Now()
		ctrl := n.connect(t)
		written := time.Now()
		d, err := w.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		waited := time.Now()
		if err := d.Verify(); err != nil {
			t.Fatal(err)
		}
		done := time.Now()
		tr := w.Trace()
		w.Close()
		lat.add("connect write -> verified device", done.Sub(start))
		lat.add("write returned -> verified device", done.Sub(written))
		lat.add("Wait returned -> verified (Verify)", done.Sub(waited))
		if m := tr.Matched.Received; !m.IsZero() {
			lat.add("matching uevent -> verified (added delay)", done.Sub(m))
			lat.add("matching uevent -> waiter woke", tr.Considered.Sub(m))
			lat.add("waiter woke -> found (sysfs read)", tr.Found.Sub(tr.Considered))
			lat.add("write returned -> matching uevent", m.Sub(written))
		} else {
			lat.add("found by the sysfs scan", 0)
		}
		if !tr.KernelEvent.Received.IsZero() {
			lat.add("last kernel uevent -> verified device", done.Sub(tr.KernelEvent.Received))
		}
		if !tr.UdevEvent.Received.IsZero() {
			lat.add("kernel uevent -> udev event", tr.UdevEvent.Received.Sub(tr.KernelEvent.Received))
		}
		attrLat.probe(d)
		t0 := time.Now()
		for range 10 {
			if _, err := (Roots{}).Lookup(d.Name); err != nil {
				t.Fatal(err)
			}
		}
		lat.add("Lookup (sysfs read of the device)", time.Since(t0)/10)
		t0 = time.Now()
		for range 10 {
			readAttr(d.sysPath, "nsid")
		}
		lat.add("one attribute: sysfs.ReadAttr by path", time.Since(t0)/10)
		if dir, err := sysfs.OpenDir(d.sysPath); err == nil {
			t0 = time.Now()
			for range 10 {
				dir.Read("nsid")
			}
			lat.add("one attribute: sysfs.Dir.Read", time.Since(t0)/10)
			dir.Close()
		}
		if round < 3 {
			logTimeline(t, round, start, written, waited, done, tr, evlog.since(start))
		}
		gone := l.subscribeRemoval(d)
		cfs(t, "/sys/class/nvme/"+ctrl+"/delete_controller", "1")
		if _, err := gone.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		gone.Close()
	}
	lat.report(t, "nvme-tcp "+benchMode(l))
	latencies(attrLat).report(t, "nvme-tcp read "+benchMode(l))
}

// attrLatencies times, once per round, each step of reading an NVMe
// namespace from sysfs right after it was verified.
type attrLatencies latencies

func (a attrLatencies) probe(d *Device) {
	t0 := time.Now()
	dir, err := sysfs.OpenDir(d.sysPath)
	if err != nil {
		return
	}
	defer dir.Close()
	latencies(a).add("open dir", time.Since(t0))
	for _, attr := range []string{"uevent", "dev", "size", "diskseq", "hidden", "device/subsysnqn", "nsid", "uuid", "nguid", "wwid"} {
		t0 := time.Now()
		dir.Read(attr)
		latencies(a).add(attr, time.Since(t0))
	}
	t0 = time.Now()
	statBlockNode(d.Path)
	latencies(a).add("stat "+d.Path, time.Since(t0))

	// The same namespace read the way an event's device used to be read
	// (whole paths through os.ReadFile, the number and node name from
	// sysfs) and the way it is now (relative to the directory, number
	// and node name from the event).
	exists := func(dir, attr string) { os.Lstat(filepath.Join(dir, attr)) }
	t0 = time.Now()
	readAttr(d.sysPath, "dev")
	readAttr(d.sysPath, "uevent")
	readAttr(d.sysPath, "size")
	readAttr(d.sysPath, "diskseq")
	exists(d.sysPath, "partition")
	readAttr(d.sysPath, "hidden")
	exists(d.sysPath, "device/subsysnqn")
	for _, attr := range []string{"device/subsysnqn", "nsid", "uuid", "nguid", "wwid"} {
		readAttr(d.sysPath, attr)
	}
	exists(d.sysPath, "dev")
	latencies(a).add("event's device, whole paths (before)", time.Since(t0))
	t0 = time.Now()
	Roots{}.readDeviceEvent(d.sysPath, "", &Event{DevName: d.Name, Major: d.Major, Minor: d.Minor, HasDevNum: true,
		Env: map[string]string{"DEVNAME": d.Name, "DEVTYPE": "disk"}})
	latencies(a).add("event's device, readDeviceEvent (after)", time.Since(t0))
}

// logTimeline logs one benchmark round: every uevent and berth's steps, in
// milliseconds after the action started.
func logTimeline(t *testing.T, round int, start, written, waited, done time.Time, tr WaitTrace, evs []EventInfo) {
	ms := func(at time.Time) string { return fmt.Sprintf("%8.2fms", float64(at.Sub(start).Microseconds())/1000) }
	var b strings.Builder
	fmt.Fprintf(&b, "round %d timeline (from scan: %v, rejected events: %d):\n", round, tr.FromScan, tr.Rejected)
	fmt.Fprintf(&b, "  %s write returned\n", ms(written))
	for _, ev := range evs {
		if !ev.Received.Before(done) {
			break
		}
		mark := ""
		if ev.Seqnum == tr.Matched.Seqnum && ev.Source == tr.Matched.Source {
			mark = "  <- matched"
		}
		fmt.Fprintf(&b, "  %s %s %s %s seq=%d%s\n", ms(ev.Received), ev.Source, ev.Action, ev.DevPath, ev.Seqnum, mark)
	}
	if !tr.Considered.IsZero() {
		fmt.Fprintf(&b, "  %s waiter woke\n", ms(tr.Considered))
	}
	fmt.Fprintf(&b, "  %s found\n  %s Wait returned\n  %s verified\n", ms(tr.Found), ms(waited), ms(done))
	t.Log(b.String())
}

// TestGuestBenchSCSI: a LUN scan on a logged-in iSCSI session, then a
// verified disk, benchRounds times (the disk is deleted between rounds).
func TestGuestBenchSCSI(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark")
	}
	ctx := benchCtx(t)
	l := guestListener(t)
	tg := newLIO(t, "devbench", backingLoop(t, l, 16<<20), "2b3c4d5e-6f70-8192-a3b4-c5d6e7f8091a", "127.0.0.1:3260")
	w := l.Subscribe(MatchSCSI("", tg.wwid()))
	loginStart := time.Now()
	tg.login(t, "127.0.0.1:3260")
	d, err := w.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	lat := latencies{}
	lat.add("login+scan -> verified disk", time.Since(loginStart))
	host := strings.SplitN(d.ID.HCTL, ":", 2)[0]
	for range benchRounds {
		if err := RemoveSCSIDevice(ctx, l, d); err != nil {
			t.Fatal(err)
		}
		w := l.Subscribe(MatchSCSI(d.ID.HCTL, tg.wwid()))
		start := time.Now()
		cfs(t, "/sys/class/scsi_host/host"+host+"/scan", "- - -")
		written := time.Now()
		if d, err = w.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if err := d.Verify(); err != nil {
			t.Fatal(err)
		}
		done := time.Now()
		tr := w.Trace()
		w.Close()
		lat.add("scan write -> verified disk", done.Sub(start))
		lat.add("scan returned -> verified disk", done.Sub(written))
		if !tr.KernelEvent.Received.IsZero() {
			lat.add("kernel uevent -> verified disk", done.Sub(tr.KernelEvent.Received))
		}
		if !tr.UdevEvent.Received.IsZero() {
			lat.add("kernel uevent -> udev event", tr.UdevEvent.Received.Sub(tr.KernelEvent.Received))
		}
	}
	lat.report(t, "iscsi "+benchMode(l))
}

// TestGuestUdevMessage parses a message systemd-udevd really sent (the
// format the unit tests build by hand) and logs it in hex, so it can be
// saved as a sample.
func TestGuestUdevMessage(t *testing.T) {
	vm.RequireGuest(t)
	if _, err := os.Stat("/run/udev/control"); err != nil {
		t.Fatalf("needs udevd: %v", err)
	}
	c, err := openUevent(groupUdev, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer c.f.Close()
	cfs(t, "/sys/class/block/loop7/uevent", "change")
	buf := make([]byte, maxMessage)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var msg []byte
		var from *unix.SockaddrNetlink
		err := c.rc.Read(func(fd uintptr) bool {
			n, _, _, sa, err := unix.Recvmsg(int(fd), buf, nil, unix.MSG_DONTWAIT)
			if errors.Is(err, unix.EAGAIN) {
				return false
			}
			if err == nil {
				msg, from = buf[:n], sa.(*unix.SockaddrNetlink)
			}
			return true
		})
		if err != nil || msg == nil {
			t.Fatalf("receive: %v", err)
		}
		ev, err := ParseUevent(msg)
		if err != nil {
			t.Fatalf("udevd's message %q: %v", msg, err)
		}
		if ev.Source != SourceUdev || from.Groups != groupUdev || from.Pid == 0 {
			t.Errorf("event %+v from %+v", ev, from)
		}
		if ev.Name() != "loop7" {
			continue
		}
		if ev.Action != "change" || ev.Major != 7 || ev.Seqnum == 0 || ev.DevName != "/dev/loop7" {
			t.Errorf("udev event %+v", ev)
		}
		t.Logf("udev message (%d bytes): %x", len(msg), msg)
		return
	}
	t.Fatal("no udev event for loop7")
}
