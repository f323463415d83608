//go:build linux

package devices

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMNVMeReservations measures what NVMe/TCP fencing builds on, against
// nvmet's reservations (Linux 6.13 on; the guest boots Debian 13
// backports' 7.3 cloud kernel) and the host's block-layer PR ioctls:
//
//   - hosts: two initiators with two host IDs in one guest, as two nodes;
//     nvme_core.multipath=N gives each controller its own block device, so
//     that every command of "node A" goes through A's controller and host
//     ID (with native multipath the kernel makes the two controllers two
//     paths of one head, whatever their host NQNs: see the multipath case).
//     nvmet tells registrants apart by host ID only, so this is what two
//     guests on a link would show, at one boot instead of three.
//   - multipath: one host ID, two ports: two controllers of one head.
//
// Measured on 7.3.4 (asserted below): a PR ioctl the target refuses with
// a reservation conflict returns PR_STS_RESERVATION_CONFLICT (0x18) as a
// positive result, no errno (NVMe status 0x4083); a non-registrant's
// O_DIRECT write under Write Exclusive - Registrants Only fails with EBADE,
// its buffered write's fsync with EIO, its reads work; a registrant's
// writes work; PREEMPT_ABORT removes the victim's key, makes the preemptor
// the holder and the victim's writes fail, but nothing stops the victim
// from registering again (and writing); IOC_PR_REGISTER with new key 0
// does not unregister on NVMe (see unregisterNVMe), and a host left with
// key 0 gets its key back only with PR_FL_IGNORE_KEY and a non-zero old
// key; nvmet reports PTPLS 0 (nothing persists); the holder's
// unregistration releases the reservation; releasing with another type,
// or as a non-registrant, conflicts; releasing nothing succeeds; the
// generation counts registrations, not reservations. Registrations belong
// to the host ID: a controller reconnect and a port removed and added
// keep them, a namespace disabled and enabled loses them. On a
// native-multipath head, IOC_PR_REGISTER goes down one path and makes one
// registrant for every controller of that host ID, also one that
// connects after the registration (writes through it alone work);
// controllers with other host IDs join the same head (the kernel groups
// them by subsystem NQN), so a node must use one host ID on every path.
func TestVMNVMeReservations(t *testing.T) {
	opts := []vm.Option{vm.WithKernel("trixie-backports"), vm.WithModules("nvmet", "nvmet_tcp", "nvme_tcp"),
		vm.WithTimeout(5 * time.Minute)}
	t.Run("hosts", func(t *testing.T) {
		vm.RunGuestTests(t, append(opts, vm.WithTestRun("^TestResvGuestNVMeHosts$"),
			vm.WithKernelArgs("nvme_core.multipath=N"))...)
	})
	t.Run("multipath", func(t *testing.T) {
		vm.RunGuestTests(t, append(opts, vm.WithTestRun("^TestResvGuestNVMeMultipath$"))...)
	})
}

// The block layer's persistent-reservation ioctls (linux/pr.h), minimal:
// the generic layer lives elsewhere; these are what the test needs.
type rawPRRegistration struct {
	oldKey, newKey uint64
	flags, _       uint32
}

const rawPRFlIgnoreKey = 1 // PR_FL_IGNORE_KEY

type rawPRReservation struct {
	key uint64
	typ uint32
	_   uint32 // flags
}

type rawPRPreempt struct {
	oldKey, newKey uint64
	typ            uint32
	_              uint32 // flags
}

type rawPRClear struct {
	key  uint64
	_, _ uint32 // flags, padding
}

// iow is _IOW('p', nr, size).
func iow(nr, size uintptr) uintptr { return 1<<30 | size<<16 | 'p'<<8 | nr }

var (
	rawIocPRRegister     = iow(200, unsafe.Sizeof(rawPRRegistration{}))
	rawIocPRReserve      = iow(201, unsafe.Sizeof(rawPRReservation{}))
	rawIocPRRelease      = iow(202, unsafe.Sizeof(rawPRReservation{}))
	rawIocPRPreempt      = iow(203, unsafe.Sizeof(rawPRPreempt{}))
	rawIocPRPreemptAbort = iow(204, unsafe.Sizeof(rawPRPreempt{}))
	rawIocPRClear        = iow(205, unsafe.Sizeof(rawPRClear{}))
)

// prResult is what a PR ioctl returned: a positive PR_STS_* status or an
// errno.
type prResult struct {
	status uintptr
	errno  unix.Errno
}

func (r prResult) String() string {
	switch {
	case r.errno != 0:
		return "errno " + r.errno.Error()
	case r.status == prStatusConflict:
		return "PR_STS_RESERVATION_CONFLICT"
	case r.status != 0:
		return fmt.Sprintf("PR status %d", r.status)
	}
	return "ok"
}

func prIoctl[T any](f *os.File, req uintptr, arg *T) prResult {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), req, uintptr(unsafe.Pointer(arg)))
	return prResult{status: r, errno: errno}
}

// nvmeNode is one initiator in the guest: a host ID, its controller and
// the namespace's block device through it.
type nvmeNode struct {
	name   string
	hostID string
	key    uint64
	ctrl   string
	dev    string
	f      *os.File
}

func (n *nvmeNode) hostNQN() string { return "nqn.2014-08.org.nvmexpress:uuid:" + n.hostID }

// connect connects n to tgt through addr and opens the namespace's block
// device (O_DIRECT: no page cache between the test and the target).
func (n *nvmeNode) connect(t *testing.T, tgt *target.NVMeTarget, addr string) {
	t.Helper()
	n.ctrl = nvmeConnectAs(t, tgt.ConnectString(addr)+",hostnqn="+n.hostNQN()+",hostid="+n.hostID+
		",reconnect_delay=1,ctrl_loss_tmo=30")
	n.open(t)
}

func (n *nvmeNode) open(t *testing.T) {
	t.Helper()
	if n.f != nil {
		n.f.Close()
	}
	n.dev = waitNamespace(t, n.ctrl)
	f, err := os.OpenFile("/dev/"+n.dev, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	n.f = f
	t.Cleanup(func() { f.Close() })
}

// waitGone waits (at most 20 s) until ctrl's namespace entry old (its
// name in /sys/class/nvme/<ctrl>) is gone.
func (n *nvmeNode) waitGone(t *testing.T, old string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat("/sys/class/nvme/" + n.ctrl + "/" + old); err != nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s still there 20 s after its namespace was disabled", n.name, old)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (n *nvmeNode) close() {
	n.f.Close()
	n.f = nil
}

func (n *nvmeNode) disconnect(t *testing.T) {
	t.Helper()
	n.f.Close()
	n.f = nil
	if err := os.WriteFile("/sys/class/nvme/"+n.ctrl+"/delete_controller", []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
}

func (n *nvmeNode) register(oldKey, newKey uint64) prResult {
	return prIoctl(n.f, rawIocPRRegister, &rawPRRegistration{oldKey: oldKey, newKey: newKey})
}

// registerIgnoringKey registers with PR_FL_IGNORE_KEY: the kernel sends
// Replace (old key not 0) or Register (old key 0) with IEKEY.
func (n *nvmeNode) registerIgnoringKey(oldKey, newKey uint64) prResult {
	return prIoctl(n.f, rawIocPRRegister, &rawPRRegistration{oldKey: oldKey, newKey: newKey, flags: rawPRFlIgnoreKey})
}

func (n *nvmeNode) reserve(typ PRType) prResult {
	return prIoctl(n.f, rawIocPRReserve, &rawPRReservation{key: n.key, typ: uint32(typ)})
}

func (n *nvmeNode) release(typ PRType) prResult {
	return prIoctl(n.f, rawIocPRRelease, &rawPRReservation{key: n.key, typ: uint32(typ)})
}

// preempt preempts the registrant with key victim, without aborting its
// commands.
func (n *nvmeNode) preempt(victim uint64, typ PRType) prResult {
	return prIoctl(n.f, rawIocPRPreempt, &rawPRPreempt{oldKey: n.key, newKey: victim, typ: uint32(typ)})
}

// preemptAbort preempts (and aborts the commands of) the registrant with
// key victim: linux/pr.h's old_key is the caller's own key, new_key the
// one to preempt (NVMe Reservation Acquire's CRKEY and PRKEY).
func (n *nvmeNode) preemptAbort(victim uint64, typ PRType) prResult {
	return prIoctl(n.f, rawIocPRPreemptAbort, &rawPRPreempt{oldKey: n.key, newKey: victim, typ: uint32(typ)})
}

func (n *nvmeNode) clear() prResult {
	return prIoctl(n.f, rawIocPRClear, &rawPRClear{key: n.key})
}

// write writes one 4 KiB block at offset 0 with O_DIRECT and returns the
// error (nil, or the errno).
func (n *nvmeNode) write(tag byte) error {
	b := alignedBlock()
	for i := range b {
		b[i] = tag
	}
	_, err := unix.Pwrite(int(n.f.Fd()), b, 0)
	return err
}

func (n *nvmeNode) read() (byte, error) {
	b := alignedBlock()
	_, err := unix.Pread(int(n.f.Fd()), b, 0)
	return b[0], err
}

func (n *nvmeNode) report(t *testing.T) Reservation {
	t.Helper()
	r, err := readReservationNVMe(n.f)
	if err != nil {
		t.Fatalf("%s: %v", n.name, err)
	}
	t.Logf("%s (%s, %s): reservation report: generation %d keys %x holder %x type %d",
		n.name, n.ctrl, n.dev, r.Generation, r.Keys, r.Holder, r.Type)
	return r
}

// alignedBlock is a 4 KiB buffer aligned for O_DIRECT.
func alignedBlock() []byte {
	b := make([]byte, 8192)
	off := 4096 - int(uintptr(unsafe.Pointer(&b[0]))&4095)
	return b[off : off+4096]
}

// nvmeConnectAs writes opts to /dev/nvme-fabrics and returns the new
// controller's name; it is deleted when the test ends.
func nvmeConnectAs(t *testing.T, opts string) string {
	t.Helper()
	f, err := os.OpenFile("/dev/nvme-fabrics", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
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

var nsEntry = regexp.MustCompile(`^nvme(\d+)(c\d+)?n(\d+)$`)

// waitNamespace returns the block device of the namespace through ctrl
// (the target has one):
// nvme<ctrl>n1 without native multipath, the head nvme<subsys>n1 of the
// path nvme<subsys>c<ctrl>n1 with it.
func waitNamespace(t *testing.T, ctrl string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ents, _ := os.ReadDir("/sys/class/nvme/" + ctrl)
		for _, e := range ents {
			if m := nsEntry.FindStringSubmatch(e.Name()); m != nil {
				dev := "nvme" + m[1] + "n" + m[3]
				if _, err := os.Stat("/dev/" + dev); err == nil {
					return dev
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no namespace through %s after 20 s", ctrl)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// logTopology logs the NVMe subsystems, their controllers and heads.
func logTopology(t *testing.T) {
	t.Helper()
	subs, _ := filepath.Glob("/sys/class/nvme-subsystem/*")
	for _, s := range subs {
		ents, _ := os.ReadDir(s)
		var names []string
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "nvme") {
				names = append(names, e.Name())
			}
		}
		t.Logf("%s: %s", filepath.Base(s), strings.Join(names, " "))
	}
	ctrls, _ := filepath.Glob("/sys/class/nvme/nvme*")
	for _, c := range ctrls {
		t.Logf("%s: cntlid %s hostnqn %s hostid %s state %s", filepath.Base(c),
			sysAttr(c, "cntlid"), sysAttr(c, "hostnqn"), sysAttr(c, "hostid"), sysAttr(c, "state"))
	}
}

func sysAttr(dir, name string) string {
	b, _ := os.ReadFile(filepath.Join(dir, name))
	return strings.TrimSpace(string(b))
}

func wantResult(t *testing.T, what string, got prResult, want prResult) {
	t.Helper()
	if got != want {
		t.Errorf("%s: %v, want %v", what, got, want)
	} else {
		t.Logf("%s: %v", what, got)
	}
}

func wantErrno(t *testing.T, what string, err error, want error) {
	t.Helper()
	if !errors.Is(err, want) && !(want == nil && err == nil) {
		t.Errorf("%s: %v, want %v", what, err, want)
	} else {
		t.Logf("%s: %v", what, err)
	}
}

func wantReservation(t *testing.T, n *nvmeNode, keys []uint64, holder uint64, typ PRType) Reservation {
	t.Helper()
	r := n.report(t)
	got, want := slices.Sorted(slices.Values(r.Keys)), slices.Sorted(slices.Values(keys))
	if !slices.Equal(got, want) || r.Holder != holder || r.Type != typ {
		t.Errorf("%s: reservation keys %x holder %x type %d, want keys %x holder %x type %d",
			n.name, r.Keys, r.Holder, r.Type, keys, holder, typ)
	}
	return r
}

const (
	resvHostA = "0a0a0a0a-0000-4000-8000-00000000000a"
	resvHostB = "0b0b0b0b-0000-4000-8000-00000000000b"
	resvKeyA  = 0xbe27a0000000000a
	resvKeyB  = 0xbe27a0000000000b
)

var prOK = prResult{}

// TestResvGuestNVMeHosts: two host IDs, one namespace, the fencing steps.
func TestResvGuestNVMeHosts(t *testing.T) {
	vm.RequireGuest(t)
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{
		Namespaces: []target.NVMeNamespace{{Reservations: true}},
	})
	// resv_enable is refused while the namespace is enabled.
	resv := filepath.Join("/sys/kernel/config/nvmet/subsystems", tgt.NQN(), "namespaces/1/resv_enable")
	if err := os.WriteFile(resv, []byte("1"), 0); err == nil {
		t.Errorf("write resv_enable of an enabled namespace: accepted")
	} else {
		t.Logf("write resv_enable of an enabled namespace: %v", err)
	}
	a := &nvmeNode{name: "A", hostID: resvHostA, key: resvKeyA}
	b := &nvmeNode{name: "B", hostID: resvHostB, key: resvKeyB}
	a.connect(t, tgt, "127.0.0.1:4420")
	b.connect(t, tgt, "127.0.0.1:4420")
	logTopology(t)
	if a.dev == b.dev {
		t.Fatalf("A and B share block device %s: need nvme_core.multipath=N", a.dev)
	}

	r0 := wantReservation(t, a, nil, 0, 0)
	wantResult(t, "register A", a.register(0, a.key), prOK)
	wantResult(t, "register B", b.register(0, b.key), prOK)
	r := wantReservation(t, b, []uint64{a.key, b.key}, 0, 0)
	t.Logf("generation %d -> %d after two registrations", r0.Generation, r.Generation)
	// Each block device reaches nvmet as its own host: the report pairs
	// each key with the host ID of the device it was registered through.
	checkHostIDs(t, b, map[uint64]string{a.key: a.hostID, b.key: b.hostID})
	// Registering again with the same key (old key 0) is what a stage
	// repeated on the same node does.
	wantResult(t, "register A again, old key 0", a.register(0, a.key), prOK)
	wantResult(t, "register A again, old key = its key", a.register(a.key, a.key), prOK)

	wantResult(t, "reserve WE-RO by A", a.reserve(PRWriteExclusiveRegOnly), prOK)
	wantReservation(t, a, []uint64{a.key, b.key}, a.key, PRWriteExclusiveRegOnly)
	wantReservation(t, b, []uint64{a.key, b.key}, a.key, PRWriteExclusiveRegOnly)
	wantResult(t, "reserve WE-RO by A again (held)", a.reserve(PRWriteExclusiveRegOnly), prOK)
	wantResult(t, "reserve WE-RO by B (A holds)", b.reserve(PRWriteExclusiveRegOnly), prResult{status: prStatusConflict})

	// WE-RO lets every registrant write: B is registered.
	wantErrno(t, "A writes", a.write('A'), nil)
	wantErrno(t, "B writes (registered, WE-RO)", b.write('B'), nil)
	// The block layer's unregister (IOC_PR_REGISTER, new key 0) does not
	// unregister on NVMe: the kernel sends Replace, nvmet keeps B as a
	// registrant with key 0, and B still writes.
	wantResult(t, "IOC_PR_REGISTER B: its key to 0", b.register(b.key, 0), prOK)
	wantReservation(t, a, []uint64{a.key, 0}, a.key, PRWriteExclusiveRegOnly)
	wantErrno(t, "B writes, registered with key 0", b.write('B'), nil)
	wantResult(t, "IOC_PR_REGISTER B, old key 0 (a registrant already)", b.register(0, b.key),
		prResult{status: prStatusConflict})
	// Nor does its old key: Replace finds key 0, not B's.
	wantResult(t, "IOC_PR_REGISTER B, old key B's own (now 0)", b.register(b.key, b.key),
		prResult{status: prStatusConflict})
	// PR_FL_IGNORE_KEY (IEKEY) helps only with a non-zero old key, any:
	// with old key 0 the kernel sends Register, which a registrant with
	// another key fails whatever IEKEY says.
	wantResult(t, "IOC_PR_REGISTER B ignoring the key, old key 0", b.registerIgnoringKey(0, b.key),
		prResult{status: prStatusConflict})
	wantResult(t, "IOC_PR_REGISTER B ignoring the key, old key 1", b.registerIgnoringKey(1, b.key), prOK)
	wantReservation(t, a, []uint64{a.key, b.key}, a.key, PRWriteExclusiveRegOnly)
	// Persist Through Power Loss: the kernel asks for it with every
	// registration (CPTPL), nvmet answers PTPLS 0: nothing survives a
	// power loss.
	raw := make([]byte, 4096)
	nsid, err := nvmeNamespaceID(b.f)
	if err == nil {
		err = nvmeResvReport(b.f, nsid, raw)
	}
	if err != nil || raw[9] != 0 {
		t.Errorf("PTPLS %d (%v), want 0", raw[9], err)
	}
	// Reservation Register with the Unregister action unregisters.
	if err := unregisterNVMe(b.f, b.key); err != nil {
		t.Errorf("unregister B: %v", err)
	}
	wantReservation(t, a, []uint64{a.key}, a.key, PRWriteExclusiveRegOnly)
	if err := unregisterNVMe(b.f, b.key); !errors.Is(err, ErrReservationConflict) {
		t.Errorf("unregister B, not registered: %v, want a reservation conflict", err)
	} else {
		t.Logf("unregister B, not registered: %v", err)
	}
	// Unregistered, B is a non-registrant: its writes conflict.
	wantErrno(t, "B writes (not registered)", b.write('B'), unix.EBADE)
	if c, err := b.read(); err != nil || c != 'B' {
		t.Errorf("B reads (not registered): %q, %v", c, err)
	} else {
		t.Logf("B reads (not registered): ok")
	}
	// A buffered write of a non-registrant: the error fsync returns.
	if bf, err := os.OpenFile("/dev/"+b.dev, os.O_RDWR, 0); err != nil {
		t.Error(err)
	} else {
		_, werr := bf.WriteAt([]byte("buffered"), 4096)
		serr := bf.Sync()
		bf.Close()
		// The write-back error reaches fsync as EIO, not EBADE.
		t.Logf("B buffered write: %v, fsync: %v", werr, serr)
		if !errors.Is(serr, unix.EIO) {
			t.Errorf("fsync of a non-registrant's buffered write: %v, want EIO", serr)
		}
	}
	wantResult(t, "register B again", b.register(0, b.key), prOK)

	// A reconnect (a new controller of the same host ID) finds A's
	// registration and reservation: they belong to the host.
	a.disconnect(t)
	wantReservation(t, b, []uint64{a.key, b.key}, a.key, PRWriteExclusiveRegOnly)
	a.connect(t, tgt, "127.0.0.1:4420")
	wantReservation(t, a, []uint64{a.key, b.key}, a.key, PRWriteExclusiveRegOnly)
	wantErrno(t, "A writes after reconnecting", a.write('A'), nil)

	// The fence: B preempts A and aborts its commands.
	wantResult(t, "preempt-abort of A by B", b.preemptAbort(a.key, PRWriteExclusiveRegOnly), prOK)
	wantReservation(t, b, []uint64{b.key}, b.key, PRWriteExclusiveRegOnly)
	wantErrno(t, "A writes after the preempt", a.write('A'), unix.EBADE)
	if _, err := a.read(); err != nil {
		t.Errorf("A reads after the preempt: %v", err)
	}
	wantErrno(t, "B writes after the preempt", b.write('B'), nil)
	wantResult(t, "reserve by A after the preempt", a.reserve(PRWriteExclusiveRegOnly), prResult{status: prStatusConflict})
	if err := unregisterNVMe(a.f, a.key); !errors.Is(err, ErrReservationConflict) {
		t.Errorf("unregister A after the preempt: %v, want a reservation conflict", err)
	} else {
		t.Logf("unregister A after the preempt: %v", err)
	}
	// Nothing but A's own node stops A from registering again: then it is
	// a registrant of a WE-RO reservation and writes.
	wantResult(t, "register A after the preempt", a.register(0, a.key), prOK)
	wantErrno(t, "A writes, registered again", a.write('A'), nil)
	wantResult(t, "preempt-abort of A by B again", b.preemptAbort(a.key, PRWriteExclusiveRegOnly), prOK)

	// Release and unregister.
	conflict := prResult{status: prStatusConflict}
	wantResult(t, "release by A (not registered)", a.release(PRWriteExclusiveRegOnly), conflict)
	wantResult(t, "release by B with another type", b.release(PRExclusiveAccess), conflict)
	wantResult(t, "release by B", b.release(PRWriteExclusiveRegOnly), prOK)
	wantReservation(t, b, []uint64{b.key}, 0, 0)
	wantResult(t, "release by B (nothing reserved)", b.release(PRWriteExclusiveRegOnly), prOK)
	wantErrno(t, "A writes (not registered, not reserved)", a.write('A'), nil)
	if err := unregisterNVMe(b.f, b.key); err != nil {
		t.Errorf("unregister B: %v", err)
	}
	wantReservation(t, b, nil, 0, 0)
	// The holder unregistering releases a registrants-only reservation.
	wantResult(t, "register A", a.register(0, a.key), prOK)
	wantResult(t, "reserve WE-RO by A", a.reserve(PRWriteExclusiveRegOnly), prOK)
	if err := unregisterNVMe(a.f, a.key); err != nil {
		t.Errorf("unregister A, the holder: %v", err)
	}
	wantReservation(t, b, nil, 0, 0)

	// An all-registrants reservation: every registrant holds it, the
	// report's holder is 0.
	wantResult(t, "register A", a.register(0, a.key), prOK)
	wantResult(t, "register B", b.register(0, b.key), prOK)
	wantResult(t, "reserve WE-AR by A", a.reserve(PRWriteExclusiveAllRegs), prOK)
	wantReservation(t, b, []uint64{a.key, b.key}, 0, PRWriteExclusiveAllRegs)
	wantResult(t, "clear by B", b.clear(), prOK)
	wantReservation(t, a, nil, 0, 0)

	// PREEMPT without abort fences as PREEMPT_ABORT does.
	wantResult(t, "register A", a.register(0, a.key), prOK)
	wantResult(t, "register B", b.register(0, b.key), prOK)
	wantResult(t, "reserve WE-RO by A", a.reserve(PRWriteExclusiveRegOnly), prOK)
	wantResult(t, "preempt of A by B", b.preempt(a.key, PRWriteExclusiveRegOnly), prOK)
	wantReservation(t, a, []uint64{b.key}, b.key, PRWriteExclusiveRegOnly)
	wantErrno(t, "A writes after the preempt", a.write('A'), unix.EBADE)
	wantResult(t, "clear by B", b.clear(), prOK)
	wantReservation(t, a, nil, 0, 0)

	// A target restart: the namespace disabled and enabled again.
	wantResult(t, "register A", a.register(0, a.key), prOK)
	wantResult(t, "reserve WE-RO by A", a.reserve(PRWriteExclusiveRegOnly), prOK)
	// Disabled until both initiators removed their block devices (which
	// the open files would hold), then enabled again.
	oldA, oldB := a.dev, b.dev
	a.close()
	b.close()
	tgt.SetNamespaceEnabled(1, false)
	a.waitGone(t, oldA)
	b.waitGone(t, oldB)
	tgt.SetNamespaceEnabled(1, true)
	a.open(t)
	b.open(t)
	// nvmet keeps reservations in the namespace's memory: a disabled
	// namespace loses them, and its generation starts at 0 again (a
	// rebooted target or a recreated subsystem, all the more).
	r = b.report(t)
	if len(r.Keys) != 0 || r.Type != 0 || r.Generation != 0 {
		t.Errorf("after a namespace restart: generation %d keys %x type %d, want 0, none, 0", r.Generation, r.Keys, r.Type)
	}
	// The port removed and added again: controllers reconnect, the
	// subsystem and its namespace stay.
	wantResult(t, "register A", a.register(0, a.key), prOK)
	wantResult(t, "reserve WE-RO by A", a.reserve(PRWriteExclusiveRegOnly), prOK)
	tgt.RemovePort("127.0.0.1:4420")
	tgt.AddPort("127.0.0.1:4420")
	waitLive(t, a.ctrl)
	waitLive(t, b.ctrl)
	wantReservation(t, b, []uint64{a.key}, a.key, PRWriteExclusiveRegOnly)
	wantResult(t, "clear by A", a.clear(), prOK)
}

// checkHostIDs reads n's raw Reservation Report and checks the host ID
// of each registrant whose key is in want.
func checkHostIDs(t *testing.T, n *nvmeNode, want map[uint64]string) {
	t.Helper()
	raw := make([]byte, 4096)
	nsid, err := nvmeNamespaceID(n.f)
	if err == nil {
		err = nvmeResvReport(n.f, nsid, raw)
	}
	if err != nil {
		t.Fatal(err)
	}
	count := int(raw[5]) | int(raw[6])<<8
	for i := range count {
		e := raw[64+64*i : 128+64*i]
		key := uint64(0)
		for j := 15; j >= 8; j-- {
			key = key<<8 | uint64(e[j])
		}
		id := strings.ReplaceAll(want[key], "-", "")
		got := fmt.Sprintf("%x", e[16:32])
		t.Logf("registrant %d: cntlid %#x rcsts %d key %x host ID %s", i, int(e[0])|int(e[1])<<8, e[2], key, got)
		if id != "" && got != id {
			t.Errorf("key %x: host ID %s, want %s", key, got, id)
		}
	}
}

func waitLive(t *testing.T, ctrl string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for sysAttr("/sys/class/nvme/"+ctrl, "state") != "live" {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s after 30 s", ctrl, sysAttr("/sys/class/nvme/"+ctrl, "state"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestResvGuestNVMeMultipath: one host ID through two ports, two
// controllers of one native-multipath head.
func TestResvGuestNVMeMultipath(t *testing.T) {
	vm.RequireGuest(t)
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{
		Namespaces: []target.NVMeNamespace{{Reservations: true}},
		Ports:      []string{"127.0.0.1:4420", "127.0.0.2:4420"},
	})
	a := &nvmeNode{name: "A", hostID: resvHostA, key: resvKeyA}
	a.connect(t, tgt, "127.0.0.1:4420")
	wantResult(t, "register A on the head", a.register(0, a.key), prOK)
	wantResult(t, "reserve WE-RO on the head", a.reserve(PRWriteExclusiveRegOnly), prOK)
	wantErrno(t, "write on the head", a.write('A'), nil)
	// A second controller of the same host ID connects after the
	// registration (a path that joins a staged volume): it is a path of
	// the same head, and nvmet keys registrants by host ID, so it is the
	// registrant the host already is: nothing registers it, and the
	// writes that go through it alone (below) work.
	a2 := &nvmeNode{name: "A'", hostID: resvHostA, key: resvKeyA}
	a2.connect(t, tgt, "127.0.0.2:4420")
	logTopology(t)
	if a.dev != a2.dev {
		t.Fatalf("two controllers of one host: block devices %s and %s, want one head", a.dev, a2.dev)
	}
	wantReservation(t, a, []uint64{a.key}, a.key, PRWriteExclusiveRegOnly)
	// Each path alone: the first port removed, then back and the second
	// removed. Writes go on through the other controller.
	for _, p := range []string{"127.0.0.1:4420", "127.0.0.2:4420"} {
		tgt.RemovePort(p)
		wantErrno(t, "write with "+p+" gone", a.write('A'), nil)
		wantReservation(t, a, []uint64{a.key}, a.key, PRWriteExclusiveRegOnly)
		tgt.AddPort(p)
		waitLive(t, a.ctrl)
		waitLive(t, a2.ctrl)
	}
	// Another host ID connecting to the same subsystem: its controller
	// joins the same head (the kernel groups by subsystem NQN), so one
	// node must use one host ID on every path.
	b := &nvmeNode{name: "B", hostID: resvHostB, key: resvKeyB}
	b.connect(t, tgt, "127.0.0.1:4420")
	logTopology(t)
	if b.dev != a.dev {
		t.Errorf("a second host ID's controller %s: block device %s, want A's head %s", b.ctrl, b.dev, a.dev)
	}
	wantResult(t, "clear by A", a.clear(), prOK)
}
