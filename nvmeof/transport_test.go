package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

func TestStatusAndHealthFromSysfs(t *testing.T) {
	sys := sampleSys(t)
	tr, err := NewTransport(Options{Sys: sys.Root(), Host: &HostIdentity{NQN: hostA, ID: hidA}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tg, err := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "targets": "127.0.0.1:4420,[::1]:4421,127.0.0.1:4429"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	head, paths, err := tg.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []PathStatus{
		{Path: "tcp:127.0.0.1:4420", Controller: "nvme1", State: "live", Device: "nvme1c1n1", ANAState: "optimized"},
		{Path: "tcp:[::1]:4421", Controller: "nvme2", State: "connecting", Device: "nvme1c2n1", ANAState: "inaccessible"},
		{Path: "tcp:127.0.0.1:4429"},
	}
	if head != "nvme1n1" || len(paths) != len(want) {
		t.Fatalf("status %s %+v", head, paths)
	}
	for i := range want {
		if paths[i] != want[i] {
			t.Errorf("path %d: %+v, want %+v", i, paths[i], want[i])
		}
	}
	states, err := tg.PathStates(ctx)
	if err != nil || len(states) != 3 || states["live"] != 1 || states["connecting"] != 1 || states["missing"] != 1 {
		t.Errorf("PathStates = %v, %v", states, err)
	}
	abnormal, msg := tg.Health(ctx)
	if !abnormal || !strings.Contains(msg, "nvme1n1: 1 of 3 paths up") || !strings.Contains(msg, "tcp:127.0.0.1:4429: no controller") {
		t.Errorf("Health = %v, %q", abnormal, msg)
	}
	// A path without a controller says why the kernel may have removed
	// it: 6.12 deletes a controller whose reconnect failed DH-HMAC-CHAP
	// authentication.
	if !strings.Contains(msg, "DH-HMAC-CHAP") || !strings.Contains(msg, "ctrl_loss_tmo") {
		t.Errorf("Health = %q: a path without a controller does not say why it may be gone", msg)
	}

	one, _ := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"}, nil)
	abnormal, msg = one.Health(ctx)
	if abnormal || !strings.Contains(msg, "1 of 1 paths up") || !strings.Contains(msg, "extra path") {
		t.Errorf("single path Health = %v, %q", abnormal, msg)
	}

	gone, _ := tr.Parse(map[string]string{"nqn": subA, "nsid": "9", "traddr": "127.0.0.1"}, nil)
	if abnormal, msg := gone.Health(ctx); !abnormal || !strings.Contains(msg, "not attached") || !strings.Contains(msg, "DH-HMAC-CHAP") {
		t.Errorf("missing namespace Health = %v, %q", abnormal, msg)
	}
	if _, err := gone.Expand(ctx); err == nil {
		t.Error("Expand without a listener succeeded")
	}
	if _, err := one.Attach(ctx); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Attach without a listener: %v", err)
	}
}

func TestSizeMatcher(t *testing.T) {
	atLeast := &sizeMatcher{name: "nvme0n1", min: 100, not: -1}
	changed := &sizeMatcher{name: "nvme0n1", not: -1}
	for _, tc := range []struct {
		m    *sizeMatcher
		d    devices.Device
		want bool
	}{
		{atLeast, devices.Device{Name: "nvme0n1", Size: 100}, true},
		{atLeast, devices.Device{Name: "nvme0n1", Size: 99}, false},
		{atLeast, devices.Device{Name: "nvme1n1", Size: 200}, false},
		{changed, devices.Device{Name: "nvme0n1", Size: 50}, false}, // old size unknown yet
	} {
		if got := tc.m.Match(&tc.d); got != tc.want {
			t.Errorf("%s Match(%s, %d) = %v", tc.m, tc.d.Name, tc.d.Size, got)
		}
	}
	changed.setNot(50)
	if changed.Match(&devices.Device{Name: "nvme0n1", Size: 50}) || !changed.Match(&devices.Device{Name: "nvme0n1", Size: 60}) {
		t.Error("size change matcher")
	}
	if atLeast.Match(nil) {
		t.Error("nil device matched")
	}
}

func TestDetachKeepsControllersOthersNeed(t *testing.T) {
	sys := sampleSys(t)
	for _, c := range []string{"nvme1", "nvme2", "nvme3"} {
		sys.File("class/nvme/"+c+"/delete_controller", "")
	}
	deleted := func() []string {
		var out []string
		for _, c := range []string{"nvme1", "nvme2", "nvme3"} {
			if readAttrT(t, sys.Root().Path("class/nvme", c), "delete_controller") == "1" {
				out = append(out, c)
			}
		}
		return out
	}
	vc1 := map[string]string{"nqn": subA, "nsid": "1", "targets": "127.0.0.1:4420,[::1]:4421"}
	vc2 := map[string]string{"nqn": subA, "nsid": "2", "traddr": "127.0.0.1"}
	vcOther := map[string]string{"nqn": "nqn.2026-01.io.berth:b", "nsid": "1", "traddr": "127.0.0.1"}
	staged := [][]map[string]string{{vc1, vc2, vcOther}}
	tr, err := NewTransport(Options{Sys: sys.Root(), DevRoot: t.TempDir(), Host: &HostIdentity{NQN: hostA, ID: hidA},
		Staged: func(context.Context) ([]map[string]string, error) { return staged[0], nil }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tg1, _ := tr.Parse(vc1, nil)
	tg2, _ := tr.Parse(vc2, nil)

	// Volume 2 still uses the 127.0.0.1:4420 path (nvme1): only the
	// ::1 path (nvme2) goes; nvme3 is being deleted already.
	if err := tg1.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if got := deleted(); len(got) != 1 || got[0] != "nvme2" {
		t.Fatalf("deleted %v, want [nvme2]", got)
	}
	// The agent still lists volume 1 (its record goes after Detach
	// returns), but this process released it: nvme1 goes now.
	if err := tg2.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if got := deleted(); len(got) != 2 || got[0] != "nvme1" {
		t.Fatalf("deleted %v, want [nvme1 nvme2]", got)
	}

	// A failing Staged callback fails the detach, deleting nothing.
	sys2 := sampleSys(t)
	sys2.File("class/nvme/nvme1/delete_controller", "")
	tr2, _ := NewTransport(Options{Sys: sys2.Root(), DevRoot: t.TempDir(), Host: &HostIdentity{NQN: hostA, ID: hidA},
		Staged: func(context.Context) ([]map[string]string, error) { return nil, errors.New("state unreadable") }})
	tg, _ := tr2.Parse(vc2, nil)
	if err := tg.Detach(ctx, nil); err == nil || !strings.Contains(err.Error(), "state unreadable") {
		t.Errorf("Detach with a failing Staged: %v", err)
	}
	if readAttrT(t, sys2.Root().Path("class/nvme/nvme1"), "delete_controller") != "" {
		t.Error("controller deleted although the staged volumes are unknown")
	}
}

func readAttrT(t *testing.T, dir, name string) string {
	t.Helper()
	s, err := sysTree{}.readAttr(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestDetachSparesAReusedControllerName: the kernel reuses a controller's
// name as soon as the controller is gone. When the volume's controller
// vanishes after detach listed it and another subsystem's new controller
// takes its name, detach must not delete that one.
func TestDetachSparesAReusedControllerName(t *testing.T) {
	sys := sampleSys(t)
	dir := sys.Root().Path("class/nvme/nvme1")
	sys.File("class/nvme/nvme1/delete_controller", "")
	vc := map[string]string{"nqn": subA, "nsid": "2", "traddr": "127.0.0.1"}
	// Once nvme1 has been listed, it goes and a controller of another
	// subsystem appears under its name.
	other := "nqn.2026-01.io.berth:other"
	swapped := false
	readFile := func(p string) ([]byte, error) {
		b, err := os.ReadFile(p)
		if p == dir+"/address" && !swapped {
			swapped = true
			sys.Remove("class/nvme/nvme1")
			for name, v := range map[string]string{"transport": "tcp", "subsysnqn": other, "state": "live",
				"hostnqn": hostA, "hostid": hidA, "address": "traddr=127.0.0.1,trsvcid=4420", "delete_controller": ""} {
				sys.File("class/nvme/nvme1/"+name, v)
			}
		}
		return b, err
	}
	tr, err := NewTransport(Options{Sys: sys.Root(), DevRoot: t.TempDir(), Host: &HostIdentity{NQN: hostA, ID: hidA},
		Staged: func(context.Context) ([]map[string]string, error) { return nil, nil }, readFile: readFile})
	if err != nil {
		t.Fatal(err)
	}
	tg, err := tr.Parse(vc, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := tg.deleteControllers(context.Background(), func(string) bool { return false }); err != nil {
		t.Fatal(err)
	}
	if !swapped {
		t.Fatal("nvme1 was never listed")
	}
	if got := readAttrT(t, dir, "delete_controller"); got != "" {
		t.Fatalf("the controller of %s that took the name nvme1 was deleted (delete_controller %q)", other, got)
	}
}

// TestAddressesReadOnlyOfTheVolumesSubsystem: a read of a TCP
// controller's address attribute while the controller is deleted
// crashes Debian 12's kernel (6.1) in the reading thread (measured in
// the guest: a reader looping over every controller's address beside
// connects and deletes of one subsystem oopsed within 20 s). Status,
// health and detach of a volume read the addresses of its own subsystem's
// controllers only, and none of a controller the kernel reports deleting.
func TestAddressesReadOnlyOfTheVolumesSubsystem(t *testing.T) {
	sys := sampleSys(t)
	other := "nqn.2026-01.io.berth:b"
	for name, v := range map[string]string{"transport": "tcp", "subsysnqn": other, "state": "live",
		"hostnqn": hostA, "hostid": hidA, "address": "traddr=127.0.0.1,trsvcid=4420"} {
		sys.File("class/nvme/nvme4/"+name, v)
	}
	for _, c := range []string{"nvme1", "nvme2", "nvme3", "nvme4"} {
		sys.File("class/nvme/"+c+"/delete_controller", "")
	}
	read := map[string]int{}
	readFile := func(p string) ([]byte, error) {
		if filepath.Base(p) == "address" {
			dir := filepath.Dir(p)
			if strings.HasPrefix(dir, "/proc/self/fd/") {
				if d, err := os.Readlink(dir); err == nil {
					dir = d
				}
			}
			read[filepath.Base(dir)]++
		}
		return os.ReadFile(p)
	}
	tr, err := NewTransport(Options{Sys: sys.Root(), DevRoot: t.TempDir(), Host: &HostIdentity{NQN: hostA, ID: hidA},
		Staged: func(context.Context) ([]map[string]string, error) { return nil, nil }, readFile: readFile})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tg, err := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "targets": "127.0.0.1:4420,[::1]:4421"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := tg.Status(ctx); err != nil {
		t.Fatal(err)
	}
	tg.Health(ctx)
	if _, err := tg.PathStates(ctx); err != nil {
		t.Fatal(err)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if read["nvme1"] == 0 || read["nvme2"] == 0 {
		t.Errorf("addresses read %v: the volume's own controllers nvme1 and nvme2 were not read", read)
	}
	if read["nvme3"] != 0 || read["nvme4"] != 0 {
		t.Errorf("addresses read %v: nvme3 (deleting) and nvme4 (subsystem %s) must not be read", read, other)
	}
	if got := readAttrT(t, sys.Root().Path("class/nvme/nvme4"), "delete_controller"); got != "" {
		t.Errorf("nvme4 of another subsystem deleted (%q)", got)
	}
}

// A namespace whose flush does not return (its I/O queued while the
// controllers reconnect) holds Detach only until the request's deadline:
// the subsystem's lock goes with it, nothing is deleted, a retry waits
// for the stuck flush without starting another, and once it returns the
// next Detach flushes and deletes.
func TestDetachFlushEndsWithContext(t *testing.T) {
	sys := sampleSys(t)
	for _, c := range []string{"nvme1", "nvme2", "nvme3"} {
		sys.File("class/nvme/"+c+"/delete_controller", "")
	}
	release := make(chan struct{})
	var flushes atomic.Int32
	old := flushDev
	flushDev = func(string) error {
		flushes.Add(1)
		<-release
		return nil
	}
	t.Cleanup(func() { flushDev = old })
	tr, err := NewTransport(Options{Sys: sys.Root(), DevRoot: t.TempDir(), Host: &HostIdentity{NQN: hostA, ID: hidA},
		Staged: func(context.Context) ([]map[string]string, error) { return nil, nil }})
	if err != nil {
		t.Fatal(err)
	}
	tg, _ := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "targets": "127.0.0.1:4420,[::1]:4421"}, nil)
	detach := func(d time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		start := time.Now()
		err := tg.Detach(ctx, nil)
		if took := time.Since(start); took > d+5*time.Second {
			t.Errorf("Detach with a %v deadline took %v", d, took)
		}
		return err
	}
	if err := detach(100 * time.Millisecond); !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Detach with a stuck flush = %v; want Unavailable and DeadlineExceeded", err)
	}
	if flushes.Load() != 1 {
		t.Fatalf("%d flushes started, want 1", flushes.Load())
	}
	short, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	unlock, err := tr.locks.Lock(short, subA)
	if err != nil {
		t.Fatalf("the subsystem's lock is still held after Detach returned: %v", err)
	}
	unlock()
	if err := detach(100 * time.Millisecond); !errors.Is(err, errdefs.ErrUnavailable) || flushes.Load() != 1 {
		t.Errorf("Detach retried during the stuck flush = %v after %d flushes; want Unavailable, and no new flush", err, flushes.Load())
	}
	if readAttrT(t, sys.Root().Path("class/nvme/nvme1"), "delete_controller") != "" {
		t.Error("a controller was deleted although its namespace was not flushed")
	}
	close(release)
	if err := detach(10 * time.Second); err != nil || flushes.Load() != 2 {
		t.Errorf("Detach once the flush returned = %v after %d flushes; want nil after 2", err, flushes.Load())
	}
	if readAttrT(t, sys.Root().Path("class/nvme/nvme1"), "delete_controller") != "1" {
		t.Error("Detach once the flush returned did not delete the controller")
	}
}

// A flush refused with a reservation conflict (NVMe Flush is a write
// command: a host another's reservation fences may not send it) does not
// hold up the detach of a refused stage or of a preempted node: nothing
// it holds can reach the namespace. Any other failed flush does.
func TestDetachFencedFlush(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		deleted bool
	}{
		{"reservation conflict", fmt.Errorf("flush /dev/nvme0n1: fsync: %w: %w", syscall.EBADE, devices.ErrReservationConflict), true},
		{"I/O error", fmt.Errorf("flush /dev/nvme0n1: fsync: %w", syscall.EIO), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sys := sampleSys(t)
			for _, c := range []string{"nvme1", "nvme2", "nvme3"} {
				sys.File("class/nvme/"+c+"/delete_controller", "")
			}
			old := flushDev
			flushDev = func(string) error { return tc.err }
			t.Cleanup(func() { flushDev = old })
			tr, err := NewTransport(Options{Sys: sys.Root(), DevRoot: t.TempDir(), Host: &HostIdentity{NQN: hostA, ID: hidA},
				Staged: func(context.Context) ([]map[string]string, error) { return nil, nil }})
			if err != nil {
				t.Fatal(err)
			}
			tg, _ := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "targets": "127.0.0.1:4420,[::1]:4421"}, nil)
			err = tg.Detach(context.Background(), nil)
			if (err == nil) != tc.deleted {
				t.Errorf("Detach = %v", err)
			}
			if got := readAttrT(t, sys.Root().Path("class/nvme/nvme1"), "delete_controller") == "1"; got != tc.deleted {
				t.Errorf("controller deleted: %t, want %t", got, tc.deleted)
			}
		})
	}
}

// Status, and so Health and PathStates, only look: without a host
// identity loaded they read the host's files and create none, and with
// none there a controller of any host counts.
func TestStatusCreatesNoHostIdentity(t *testing.T) {
	hostDir := t.TempDir()
	tr, err := NewTransport(Options{Sys: sampleSys(t).Root(), HostDir: hostDir})
	if err != nil {
		t.Fatal(err)
	}
	tg, err := tr.Parse(map[string]string{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if abnormal, msg := tg.Health(context.Background()); abnormal {
		t.Errorf("Health = %v, %q", abnormal, msg)
	}
	if states, err := tg.PathStates(context.Background()); err != nil || states["live"] != 1 {
		t.Errorf("PathStates = %v, %v", states, err)
	}
	if ents, err := os.ReadDir(hostDir); err != nil || len(ents) != 0 {
		t.Errorf("host directory after Health and PathStates: %v, %v; want it empty", ents, err)
	}
}
