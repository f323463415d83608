package iscsi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs"
	"github.com/berth-csi/berth/test/vm"
)

var lioModules = []string{"iscsi_tcp", "target_core_mod", "target_core_iblock", "iscsi_target_mod", "loop"}

// TestVMISCSI runs the single-path in-guest tests against LIO on loopback.
func TestVMISCSI(t *testing.T) {
	vm.RunGuestTests(t,
		vm.WithTestRun(guestRun("^TestGuestISCSI")),
		vm.WithModules(lioModules...),
		vm.WithIscsid(),
		vm.WithTimeout(6*time.Minute))
}

// TestVMISCSIMultipath runs the multipath in-guest tests with multipathd.
func TestVMISCSIMultipath(t *testing.T) {
	vm.RunGuestTests(t,
		vm.WithTestRun(guestRun("^TestMultipathISCSI")),
		vm.WithModules(lioModules...),
		vm.WithIscsid(),
		vm.WithMultipathd(),
		vm.WithTimeout(6*time.Minute))
}

// TestVMBenchISCSI measures NodeStageVolume against iscsiadm login + mkfs +
// mount by hand in one guest, one volume at a time (TestBenchGuestISCSI)
// and 8 at once (TestBenchGuestISCSIConcurrent). It runs for `make bench`
// only:
//
//	BERTH_BENCH=1 go test -count=1 -run '^TestVMBenchISCSI$' -v ./iscsi/ | grep 'BENCH iscsi-stage'
func TestVMBenchISCSI(t *testing.T) {
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: runs with BERTH_BENCH=1 (make bench)")
	}
	vm.RunGuestTests(t,
		vm.WithTestRun(guestRun("^TestBenchGuestISCSI")),
		vm.WithModules(lioModules...),
		vm.WithIscsid(),
		vm.WithEnv(map[string]string{"BERTH_BENCH": "1"}),
		vm.WithTimeout(15*time.Minute))
}

// guestRun narrows the in-guest tests to BERTH_ISCSI_RUN when it is set
// (a regexp of in-guest test names), to iterate on one of them.
func guestRun(all string) string {
	if r := os.Getenv("BERTH_ISCSI_RUN"); r != "" {
		return r
	}
	return all
}

// GuestRun is guestRun for the package's external tests (its fault
// tests' entry points).
var GuestRun = guestRun

// guestTransport returns a transport on a fresh listener.
func guestTransport(t *testing.T, opts Options) *Transport {
	t.Helper()
	vm.RequireGuest(t)
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	opts.Listener = l
	opts.Logger = slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	tr, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

func target(t *testing.T, tr *Transport, vc map[string]string, secrets map[string]string) *Target {
	t.Helper()
	tg, err := tr.Parse(vc, secrets)
	if err != nil {
		t.Fatal(err)
	}
	return tg
}

func vctx(tg *lioTarget, lun int, kv ...string) map[string]string {
	m := map[string]string{"iqn": tg.IQN, "lun": strconv.Itoa(lun), "targetPortal": tg.tpgs[1]}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

// sessionsOf lists the sessions of a target.
func sessionsOf(t *testing.T, iqn string) []Session {
	t.Helper()
	all, err := sysTree{}.Sessions(iqn)
	if err != nil {
		t.Fatal(err)
	}
	var out []Session
	for _, s := range all {
		if s.Target == iqn {
			out = append(out, s)
		}
	}
	return out
}

func lunsOf(t *testing.T, sid int) []HCTL {
	t.Helper()
	l, err := sysTree{}.LUNs(sid)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func assertDetached(t *testing.T, iqn string) {
	t.Helper()
	if s := sessionsOf(t, iqn); len(s) != 0 {
		t.Fatalf("sessions left after detach: %+v", s)
	}
	for _, d := range []string{"/etc/iscsi/nodes", "/var/lib/iscsi/nodes"} {
		if _, err := os.Stat(filepath.Join(d, iqn)); err == nil {
			ents, _ := os.ReadDir(filepath.Join(d, iqn))
			if len(ents) > 0 {
				t.Fatalf("node records left in %s/%s", d, iqn)
			}
		}
	}
}

func TestGuestISCSILoginScanLogout(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 32<<20)
	wwid := lt.AddLUN(1, 48<<20)
	tg := target(t, tr, vctx(lt, 1, "wwid", wwid), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	start := time.Now()
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("attached %s (%s, %s) in %v", dev.Path, dev.ID.HCTL, dev.ID.WWID, time.Since(start))
	if dev.Size != 48<<20 || devices.NormalizeWWID(dev.ID.WWID) != wwid {
		t.Fatalf("wrong device: size %d wwid %s", dev.Size, dev.ID.WWID)
	}
	ss := sessionsOf(t, lt.IQN)
	if len(ss) != 1 {
		t.Fatalf("want one session, got %+v", ss)
	}
	// Only the asked LUN was scanned in.
	if luns := lunsOf(t, ss[0].ID); len(luns) != 1 || luns[0].LUN != 1 {
		t.Fatalf("session has LUNs %v, want only LUN 1", luns)
	}
	// The record says manual scan and manual startup, and is root-only.
	files, err := tr.db.nodeRecordFiles(lt.IQN, "127.0.0.1", 3260, "default")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(files[0])
	rec := parseRecord(b)
	if rec["node.session.scan"] != "manual" || rec["node.startup"] != "manual" {
		t.Fatalf("record: scan=%q startup=%q", rec["node.session.scan"], rec["node.startup"])
	}
	// Idempotent.
	dev2, err := tg.Attach(ctx)
	if err != nil || dev2.Name != dev.Name {
		t.Fatalf("second attach: %v %v", dev2, err)
	}
	if abnormal, msg := tg.Health(ctx); abnormal {
		t.Fatalf("health: %s", msg)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, lt.IQN)
	if _, err := os.Stat("/sys/class/block/" + dev.Name); err == nil {
		t.Fatalf("%s still exists", dev.Name)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatalf("second detach: %v", err)
	}
}

func TestGuestISCSIWWIDMismatch(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 16<<20)
	tg := target(t, tr, vctx(lt, 0, "wwid", "naa.60014050000000000000000000000000"), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := tg.Attach(ctx)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "WWID") {
		t.Fatalf("want a WWID refusal, got %v", err)
	}
	t.Log(err)
	assertDetached(t, lt.IQN)
}

func TestGuestISCSINoSuchLUN(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 16<<20)
	tg := target(t, tr, vctx(lt, 5), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	_, err := tg.Attach(ctx)
	if !errors.Is(err, errdefs.ErrNotFound) || ctx.Err() != nil {
		t.Fatalf("want a prompt not-found, got %v after %v", err, time.Since(start))
	}
	t.Log(err)
	assertDetached(t, lt.IQN)
}

func TestGuestISCSINodeNotReady(t *testing.T) {
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 16<<20)
	ctx := context.Background()
	tr := guestTransport(t, Options{InitiatorNameFile: "/nonexistent/initiatorname.iscsi"})
	if _, err := target(t, tr, vctx(lt, 0), nil).Attach(ctx); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "initiator name") {
		t.Fatalf("missing initiator name: %v", err)
	}
	tr = guestTransport(t, Options{Iscsiadm: "/nonexistent/iscsiadm"})
	if _, err := target(t, tr, vctx(lt, 0), nil).Attach(ctx); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("missing iscsiadm: %v", err)
	}
	tr = guestTransport(t, Options{Sys: sysfs.At(t.TempDir())})
	if _, err := target(t, tr, vctx(lt, 0), nil).Attach(ctx); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "iscsi_tcp") {
		t.Fatalf("no iscsi_tcp: %v", err)
	}
	// iscsid out of reach: a wrapper (as --iscsiadm takes) runs iscsiadm in
	// a network namespace of its own, where iscsid's abstract socket does
	// not exist.
	wrapper := filepath.Join(t.TempDir(), "iscsiadm-isolated")
	if err := os.WriteFile(wrapper, []byte("#!/bin/sh\nexec unshare -n iscsiadm \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	tr = guestTransport(t, Options{Iscsiadm: wrapper})
	_, err := target(t, tr, vctx(lt, 0), nil).Attach(ctx)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "iscsid is not running") {
		t.Fatalf("iscsid unreachable: %v", err)
	}
	t.Log(err)
	// Several portals without multipathd: a clear error, unless single path
	// is asked for.
	tr = guestTransport(t, Options{})
	_, err = target(t, tr, vctx(lt, 0, "portals", "127.0.0.2:3260"), nil).Attach(ctx)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "multipath") {
		t.Fatalf("two portals without multipathd: %v", err)
	}
	assertDetached(t, lt.IQN)
}

// TestGuestISCSIHostnamePortals: portals given as host names are resolved
// for the node record and the sysfs match; with multipath "false", the
// first portal that answers is used alone.
func TestGuestISCSIHostnamePortals(t *testing.T) {
	tr := guestTransport(t, Options{})
	hosts, _ := os.ReadFile("/etc/hosts")
	if !bytes.Contains(hosts, []byte("san-a.berth.test")) {
		f, err := os.OpenFile("/etc/hosts", os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintln(f, "127.0.0.1 san-a.berth.test")
		fmt.Fprintln(f, "127.0.0.3 san-dead.berth.test")
		f.Close()
	}
	lt := newLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddLUN(0, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	// The first portal does not answer (nothing listens on 127.0.0.3).
	tg := target(t, tr, map[string]string{"iqn": lt.IQN, "lun": "0", "wwid": wwid, "multipath": "false",
		"portals": `["san-dead.berth.test:3260","san-a.berth.test:3260"]`, ParamLoginTimeout: "2", ParamLoginRetryMax: "1"}, nil)
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ss := sessionsOf(t, lt.IQN)
	if len(ss) != 1 || ss[0].PersistentAddress != "127.0.0.1" {
		t.Fatalf("sessions: %+v", ss)
	}
	if _, err := tr.db.nodeRecordFiles(lt.IQN, "127.0.0.1", 3260, "default"); err != nil {
		t.Fatalf("the record is not under the portal's address: %v", err)
	}
	t.Logf("attached %s through the second portal", dev.Path)
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, lt.IQN)
}

// cmdlineSampler reads every process's argv until stopped and reports any
// that holds one of the needles.
type cmdlineSampler struct {
	stop    chan struct{}
	done    chan struct{}
	samples atomic.Int64
	mu      sync.Mutex
	leaks   []string
}

func sampleCmdlines(needles ...string) *cmdlineSampler {
	s := &cmdlineSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		self := strconv.Itoa(os.Getpid())
		for {
			select {
			case <-s.stop:
				return
			default:
			}
			ents, _ := os.ReadDir("/proc")
			for _, e := range ents {
				if e.Name() == self || e.Name()[0] < '0' || e.Name()[0] > '9' {
					continue
				}
				b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
				if err != nil || len(b) == 0 {
					continue
				}
				s.samples.Add(1)
				for _, n := range needles {
					if bytes.Contains(b, []byte(n)) {
						s.mu.Lock()
						s.leaks = append(s.leaks, strings.ReplaceAll(string(b), "\x00", " "))
						s.mu.Unlock()
					}
				}
			}
		}
	}()
	return s
}

func (s *cmdlineSampler) Stop() (int64, []string) {
	close(s.stop)
	<-s.done
	return s.samples.Load(), s.leaks
}

func TestGuestISCSICHAP(t *testing.T) {
	for _, mutual := range []bool{false, true} {
		t.Run(fmt.Sprintf("mutual=%v", mutual), func(t *testing.T) {
			tr := guestTransport(t, Options{})
			lt := newLIOTarget(t, "127.0.0.1:3260")
			wwid := lt.AddLUN(0, 16<<20)
			sec := map[string]string{SecretSessionUsername: "berthuser", SecretSessionPassword: "Secr3t-Pw-0n3way"}
			inPass := "Secr3t-Pw-mutual"
			if mutual {
				sec[SecretSessionUsernameIn] = "berthtarget"
				sec[SecretSessionPasswordIn] = inPass
				lt.SetCHAP("berthuser", sec[SecretSessionPassword], "berthtarget", inPass)
			} else {
				lt.SetCHAP("berthuser", sec[SecretSessionPassword], "", "")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()

			sampler := sampleCmdlines(sec[SecretSessionPassword], inPass)
			tg := target(t, tr, vctx(lt, 0, "sessionCHAPAuth", "true", "wwid", wwid), sec)
			dev, err := tg.Attach(ctx)
			n, leaks := sampler.Stop()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("attached %s with CHAP; %d argv samples taken", dev.Path, n)
			if len(leaks) > 0 {
				t.Fatalf("a secret appeared in a process's argv: %q", leaks)
			}
			if n == 0 {
				t.Fatal("the sampler read no argv")
			}
			files, err := tr.db.nodeRecordFiles(lt.IQN, "127.0.0.1", 3260, "default")
			if err != nil {
				t.Fatal(err)
			}
			if st, _ := os.Stat(files[0]); st.Mode().Perm() != 0o600 {
				t.Fatalf("record with secrets has mode %v", st.Mode().Perm())
			}
			if err := tg.Detach(ctx, nil); err != nil {
				t.Fatal(err)
			}
			assertDetached(t, lt.IQN)

			// Wrong password: a clear authentication error, well before
			// any timeout, nothing left behind.
			bad := maps.Clone(sec)
			bad[SecretSessionPassword] = "Wrong-Password-1"
			start := time.Now()
			_, err = target(t, tr, vctx(lt, 0, "sessionCHAPAuth", "true"), bad).Attach(ctx)
			if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "authentication") {
				t.Fatalf("wrong password: %v", err)
			}
			if strings.Contains(err.Error(), "Wrong-Password-1") || strings.Contains(err.Error(), sec[SecretSessionPassword]) {
				t.Fatalf("error holds the password: %v", err)
			}
			t.Logf("wrong password refused in %v: %v", time.Since(start), err)
			if time.Since(start) > 20*time.Second {
				t.Fatalf("refusal took %v", time.Since(start))
			}
			assertDetached(t, lt.IQN)
		})
	}
}

func TestGuestISCSIDiscoveryCHAP(t *testing.T) {
	for _, mutual := range []bool{false, true} {
		t.Run(fmt.Sprintf("mutual=%v", mutual), func(t *testing.T) {
			tr := guestTransport(t, Options{})
			lt := newLIOTarget(t, "127.0.0.1:3260")
			wwid := lt.AddLUN(0, 16<<20)
			sec := map[string]string{SecretDiscoveryUsername: "discuser", SecretDiscoveryPassword: "Disc-Secr3t-One"}
			if mutual {
				sec[SecretDiscoveryUsernameIn] = "disctarget"
				sec[SecretDiscoveryPasswordIn] = "Disc-Secr3t-Two"
			}
			lt.SetDiscoveryCHAP("discuser", sec[SecretDiscoveryPassword], sec[SecretDiscoveryUsernameIn], sec[SecretDiscoveryPasswordIn])
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			sampler := sampleCmdlines(sec[SecretDiscoveryPassword], "Disc-Secr3t-Two")
			tg := target(t, tr, vctx(lt, 0, "discoveryCHAPAuth", "true", "wwid", wwid), sec)
			dev, err := tg.Attach(ctx)
			n, leaks := sampler.Stop()
			if err != nil {
				t.Fatal(err)
			}
			if len(leaks) > 0 || n == 0 {
				t.Fatalf("argv samples %d, leaks %q", n, leaks)
			}
			// Discovery stored nothing: one record, for the volume's portal,
			// and no discovery record holding the credentials.
			if ents, _ := os.ReadDir("/etc/iscsi/send_targets"); len(ents) != 0 {
				t.Fatalf("discovery records left: %v", ents)
			}
			t.Logf("attached %s after discovery with CHAP", dev.Path)
			if err := tg.Detach(ctx, nil); err != nil {
				t.Fatal(err)
			}
			assertDetached(t, lt.IQN)

			bad := maps.Clone(sec)
			bad[SecretDiscoveryPassword] = "Wrong-Disc-Pass"
			_, err = target(t, tr, vctx(lt, 0, "discoveryCHAPAuth", "true"), bad).Attach(ctx)
			if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "authentication") {
				t.Fatalf("wrong discovery password: %v", err)
			}
			t.Logf("wrong discovery password: %v", err)
			assertDetached(t, lt.IQN)
		})
	}
}

func TestGuestISCSIDiscoveryWrongTarget(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 16<<20)
	vc := vctx(lt, 0, "discovery", "true")
	vc["iqn"] = lt.IQN + "-other"
	_, err := target(t, tr, vc, nil).Attach(context.Background())
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "does not offer") {
		t.Fatalf("target not offered: %v", err)
	}
}

// TestGuestISCSIDiscoveryStaleRecord: a discovery record that a berth
// killed in the middle of a discovery left at the portal, with mutual
// CHAP credentials in it, does not stop the next discovery there (the
// target asks for no authentication), and that discovery deletes it:
// the credentials stay on the node only until then.
func TestGuestISCSIDiscoveryStaleRecord(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddLUN(0, 16<<20)
	portal := lt.Portal(1)
	iscsiadm := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("iscsiadm", append([]string{"-m", "discoverydb", "-t", "sendtargets", "-p", portal}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("iscsiadm %v: %v: %s", args, err, out)
		}
	}
	iscsiadm("-o", "new")
	for _, kv := range [][2]string{
		{"discovery.sendtargets.auth.authmethod", "CHAP"},
		{SecretDiscoveryUsername, "stale-user"}, {SecretDiscoveryPassword, "stale-secret-1"},
		{SecretDiscoveryUsernameIn, "stale-target"}, {SecretDiscoveryPasswordIn, "stale-secret-2"},
	} {
		iscsiadm("-o", "update", "-n", kv[0], "-v", kv[1])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tg := target(t, tr, vctx(lt, 0, "discovery", "true", "wwid", wwid), nil)
	if _, err := tg.Attach(ctx); err != nil {
		t.Fatalf("attach with a stale discovery record at the portal: %v", err)
	}
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, lt.IQN)
	if out, err := exec.Command("iscsiadm", "-m", "discoverydb").CombinedOutput(); err == nil && strings.Contains(string(out), "127.0.0.1") {
		t.Fatalf("discovery records left: %s", out)
	}
}

// writeLoop writes and syncs to dev until stopped; it returns the number
// of writes and the first error.
func writeLoop(path string, stop <-chan struct{}, count *atomic.Int64) (int, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_SYNC, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := bytes.Repeat([]byte{0xa5}, 4096)
	n := 0
	for {
		select {
		case <-stop:
			return n, nil
		default:
		}
		if _, err := f.WriteAt(buf, int64(n%256)*4096); err != nil {
			return n, err
		}
		n++
		if count != nil {
			count.Add(1)
		}
	}
}

func TestGuestISCSITwoLUNsOneSession(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	w0 := lt.AddLUN(0, 16<<20)
	w1 := lt.AddLUN(1, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	a := target(t, tr, vctx(lt, 0, "wwid", w0), nil)
	b := target(t, tr, vctx(lt, 1, "wwid", w1), nil)
	da, err := a.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Attach(ctx); err != nil {
		t.Fatal(err)
	}
	ss := sessionsOf(t, lt.IQN)
	if len(ss) != 1 || len(lunsOf(t, ss[0].ID)) != 2 {
		t.Fatalf("want one session with two LUNs: %+v", ss)
	}
	stop := make(chan struct{})
	var writes int
	var werr error
	done := make(chan struct{})
	go func() { writes, werr = writeLoop(da.Path, stop, nil); close(done) }()
	if err := b.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // let the writer run on after the detach
	close(stop)
	<-done
	if werr != nil {
		t.Fatalf("I/O on LUN 0 failed while LUN 1 was detached: %v", werr)
	}
	ss2 := sessionsOf(t, lt.IQN)
	if len(ss2) != 1 || ss2[0].ID != ss[0].ID {
		t.Fatalf("the shared session changed: before %+v after %+v", ss, ss2)
	}
	if luns := lunsOf(t, ss[0].ID); len(luns) != 1 || luns[0].LUN != 0 {
		t.Fatalf("LUNs after detaching LUN 1: %v", luns)
	}
	if err := da.Verify(); err != nil {
		t.Fatalf("LUN 0 device changed: %v", err)
	}
	t.Logf("%d writes on LUN 0 while LUN 1 was detached", writes)
	if err := a.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, lt.IQN)
}

// TestGuestISCSILUNsWaitApart: attaches of two LUNs of one session do not
// wait for each other's disk. LUN 0's attach is held after its scan,
// before its disk wait; LUN 1's attach must finish meanwhile (with the
// path's lock held across the disk wait it waits for LUN 0 for ever).
func TestGuestISCSILUNsWaitApart(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	w0 := lt.AddLUN(0, 16<<20)
	w1 := lt.AddLUN(1, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	held, release := make(chan struct{}), make(chan struct{})
	tr.testHookDiskWait = func(lun int) {
		if lun == 0 {
			close(held)
			<-release
		}
	}
	a := target(t, tr, vctx(lt, 0, "wwid", w0), nil)
	b := target(t, tr, vctx(lt, 1, "wwid", w1), nil)
	aerr := make(chan error, 1)
	go func() {
		_, err := a.Attach(ctx)
		aerr <- err
	}()
	<-held
	bdone := make(chan error, 1)
	go func() {
		_, err := b.Attach(ctx)
		bdone <- err
	}()
	select {
	case err := <-bdone:
		if err != nil {
			t.Fatalf("attach LUN 1: %v", err)
		}
	case <-time.After(45 * time.Second):
		close(release)
		t.Fatalf("attach of LUN 1 did not finish in 45 s while LUN 0's attach waited for its disk: %v", <-bdone)
	}
	close(release)
	if err := <-aerr; err != nil {
		t.Fatalf("attach LUN 0: %v", err)
	}
	ss := sessionsOf(t, lt.IQN)
	if len(ss) != 1 || len(lunsOf(t, ss[0].ID)) != 2 {
		t.Fatalf("want one session with two LUNs: %+v", ss)
	}
	for _, tg := range []*Target{b, a} {
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
	}
	assertDetached(t, lt.IQN)
}

// TestGuestISCSIFailedAttachAfterDetach: an attach that scanned in LUN 1
// of a session and then fails (the WWID is not the volume's) logs the
// session out when LUN 0's detach, which ran while LUN 1 waited for its
// disk, left it only for LUN 1. Nothing stays behind.
func TestGuestISCSIFailedAttachAfterDetach(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	w0 := lt.AddLUN(0, 16<<20)
	lt.AddLUN(1, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	a := target(t, tr, vctx(lt, 0, "wwid", w0), nil)
	if _, err := a.Attach(ctx); err != nil {
		t.Fatal(err)
	}
	held, release := make(chan struct{}), make(chan struct{})
	tr.testHookDiskWait = func(lun int) {
		if lun == 1 {
			close(held)
			<-release
		}
	}
	b := target(t, tr, vctx(lt, 1, "wwid", "naa.60014050000000000000000000000000"), nil)
	berr := make(chan error, 1)
	go func() {
		_, err := b.Attach(ctx)
		berr <- err
	}()
	<-held
	if err := a.Detach(ctx, nil); err != nil {
		close(release)
		t.Fatalf("detach LUN 0 while LUN 1 waits for its disk: %v", err)
	}
	close(release)
	if err := <-berr; !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("attach LUN 1 with another WWID: %v, want FailedPrecondition", err)
	}
	assertDetached(t, lt.IQN)
}

func TestGuestISCSILUNDeletedFirst(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddLUN(0, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tg := target(t, tr, vctx(lt, 0), nil)
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	lt.RemoveLUN(0)
	dctx, dcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer dcancel()
	start := time.Now()
	if err := tg.Detach(dctx, nil); err != nil {
		t.Fatalf("detach after the LUN was deleted: %v (after %v)", err, time.Since(start))
	}
	t.Logf("detached in %v", time.Since(start))
	assertDetached(t, lt.IQN)
	if _, err := os.Stat("/sys/class/block/" + dev.Name); err == nil {
		t.Fatalf("%s still exists", dev.Name)
	}
}

func TestGuestISCSITargetGone(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddCachedLUN(0, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tg := target(t, tr, vctx(lt, 0, ParamReplacementTimeout, "120"), nil)
	dev, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if wc, _ := os.ReadFile("/sys/class/block/" + dev.Name + "/queue/write_cache"); !strings.HasPrefix(string(wc), "write back") {
		t.Fatalf("the LUN reports no write cache (%q): the test would not exercise SYNCHRONIZE CACHE", wc)
	}
	// The whole target goes away; the session goes into recovery with a
	// replacement timeout far beyond the detach's deadline.
	lt.Vanish(1)
	deadline := 30 * time.Second
	dctx, dcancel := context.WithTimeout(context.Background(), deadline)
	defer dcancel()
	start := time.Now()
	err = tg.Detach(dctx, nil)
	el := time.Since(start)
	t.Logf("detach of a dead target: %v in %v", err, el)
	if el > deadline+2*time.Second {
		t.Fatalf("detach ran %v past its %v deadline", el, deadline)
	}
	if err != nil {
		t.Fatal(err)
	}
	assertDetached(t, lt.IQN)
	if _, err := os.Stat("/sys/class/block/" + dev.Name); err == nil {
		t.Fatalf("%s still exists", dev.Name)
	}
}

// TestGuestISCSITargetGoneSharedSession: the dead session still has
// another volume's LUN, so it stays; the detach still returns by its
// deadline and a retry after the replacement timeout completes.
func TestGuestISCSITargetGoneSharedSession(t *testing.T) {
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260")
	lt.AddCachedLUN(0, 16<<20)
	lt.AddCachedLUN(1, 16<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	a := target(t, tr, vctx(lt, 0, ParamReplacementTimeout, "8"), nil)
	b := target(t, tr, vctx(lt, 1, ParamReplacementTimeout, "8"), nil)
	if _, err := a.Attach(ctx); err != nil {
		t.Fatal(err)
	}
	db, err := b.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	lt.Vanish(1)
	waitFor(t, 30*time.Second, "the session to fail", func() bool {
		ss := sessionsOf(t, lt.IQN)
		return len(ss) == 1 && ss[0].State != "LOGGED_IN"
	})
	deadline := 3 * time.Second
	dctx, dcancel := context.WithTimeout(context.Background(), deadline)
	defer dcancel()
	start := time.Now()
	err = b.Detach(dctx, nil)
	el := time.Since(start)
	t.Logf("detach on a dead shared session: %v in %v", err, el)
	if el > deadline+2*time.Second {
		t.Fatalf("detach ran %v past its %v deadline", el, deadline)
	}
	// Once the replacement timeout has failed the session's I/O, a retry
	// finishes the job; the session stays for the other LUN.
	waitFor(t, 60*time.Second, "a detach retry to succeed", func() bool {
		rctx, rcancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer rcancel()
		return b.Detach(rctx, nil) == nil
	})
	if _, err := os.Stat("/sys/class/block/" + db.Name); err == nil {
		t.Fatalf("%s still exists", db.Name)
	}
	if ss := sessionsOf(t, lt.IQN); len(ss) != 1 {
		t.Fatalf("the shared session should stay for LUN 0: %+v", ss)
	}
	if err := a.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, lt.IQN)
}

// --- multipath (guest with multipathd) ---

// startMultipathd starts multipathd in the guest unless it runs; its
// messages go to the test log.
func startMultipathd(t *testing.T) {
	t.Helper()
	vm.RequireGuest(t)
	if _, err := (execRunner{}).run(context.Background(), "multipathd", "show", "daemon"); err == nil {
		return
	}
	cmd := exec.Command("multipathd", "-d", "-s")
	cmd.Stdout, cmd.Stderr = testWriter{t}, testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start multipathd: %v", err)
	}
	t.Cleanup(func() {
		(execRunner{}).run(context.Background(), "multipathd", "shutdown")
		cmd.Wait()
	})
	var last error
	end := time.Now().Add(20 * time.Second)
	for time.Now().Before(end) {
		if _, last = (execRunner{}).run(context.Background(), "multipathd", "show", "daemon"); last == nil {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("multipathd does not answer: %v", last)
}

func TestMultipathISCSIFailoverAndExpand(t *testing.T) {
	startMultipathd(t)
	tr := guestTransport(t, Options{})
	lt := newLIOTarget(t, "127.0.0.1:3260", "127.0.0.2:3260")
	wwid := lt.AddLUN(0, 32<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tg := target(t, tr, vctx(lt, 0, "portals", `["127.0.0.1:3260","127.0.0.2:3260"]`, "wwid", wwid,
		ParamReplacementTimeout, "3"), nil)
	dm, err := tg.Attach(ctx)
	if err != nil {
		t.Fatal(err)
	}
	slaves, _ := devices.Roots{}.Slaves(dm.Name)
	t.Logf("map %s (%s) over %v", dm.Path, dm.ID.DMName, slaves)
	if dm.ID.Kind != devices.KindDM || len(slaves) != 2 {
		t.Fatalf("want a dm map over two paths, got %s kind %s slaves %v", dm.Name, dm.ID.Kind, slaves)
	}

	// berth_volume_paths: both sessions live.
	if ps, err := tg.PathStates(ctx); err != nil || ps["live"] != 2 || len(ps) != 1 {
		t.Fatalf("PathStates with both portals up: %v, %v; want 2 live", ps, err)
	}

	stop := make(chan struct{})
	var writes int
	var werr error
	var count atomic.Int64
	done := make(chan struct{})
	go func() { writes, werr = writeLoop(dm.Path, stop, &count); close(done) }()
	time.Sleep(500 * time.Millisecond)
	lt.Vanish(2)
	// Wait until the path is reported failed while writes go on.
	waitFor(t, 60*time.Second, "a failed path", func() bool {
		abnormal, msg := tg.Health(ctx)
		return abnormal && strings.Contains(msg, "127.0.0.2")
	})
	if ps, err := tg.PathStates(ctx); err != nil || ps["live"] != 1 || len(ps) != 2 {
		t.Errorf("PathStates with one portal gone: %v, %v; want 1 live and 1 in another state", ps, err)
	} else {
		t.Logf("path states with one portal gone: %v", ps)
	}
	before := count.Load()
	time.Sleep(2 * time.Second)
	lt.Restore(2)
	last := time.Now()
	waitFor(t, 90*time.Second, "both paths back", func() bool {
		abnormal, msg := tg.Health(ctx)
		active := mpathActivePaths(t, dm)
		if time.Since(last) > 10*time.Second {
			last = time.Now()
			paths, _ := (execRunner{}).run(ctx, "multipathd", "show", "paths")
			t.Logf("waiting: health %v %q, active paths %d, sessions %+v\n%s", abnormal, msg, active, sessionsOf(t, lt.IQN), paths)
		}
		return !abnormal && active == 2
	})
	close(stop)
	<-done
	if werr != nil {
		t.Fatalf("I/O error on the map during failover: %v", werr)
	}
	t.Logf("%d writes without error (%d before the path failed)", writes, before)

	lt.Grow(0, 64<<20)
	size, err := tg.Expand(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d, _ := devices.Roots{}.Lookup(dm.Name)
	if size != 64<<20 || d.Size != 64<<20 {
		t.Fatalf("after expand: returned %d, map %d, want %d", size, d.Size, 64<<20)
	}
	for _, s := range slaves {
		if p, _ := (devices.Roots{}).Lookup(s); p.Size != 64<<20 {
			t.Fatalf("path %s has %d bytes", s, p.Size)
		}
	}

	// udev probes the map after its change event; let it finish, as it
	// would long before a real unstage.
	(execRunner{}).run(ctx, "udevadm", "settle", "--timeout=30")
	if err := tg.Detach(ctx, nil); err != nil {
		t.Fatalf("%v; openers: %s", err, openers(dm))
	}
	if _, err := os.Stat("/sys/class/block/" + dm.Name); err == nil {
		t.Fatalf("map %s still exists", dm.Name)
	}
	assertDetached(t, lt.IQN)
}

// openers lists the processes that hold dev open.
func openers(dev *devices.Device) string {
	var out []string
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		fds, _ := os.ReadDir("/proc/" + p.Name() + "/fd")
		for _, fd := range fds {
			if l, err := os.Readlink("/proc/" + p.Name() + "/fd/" + fd.Name()); err == nil && l == dev.Path {
				comm, _ := os.ReadFile("/proc/" + p.Name() + "/comm")
				out = append(out, p.Name()+":"+strings.TrimSpace(string(comm)))
			}
		}
	}
	return fmt.Sprint(out)
}

// mpathActivePaths counts the map's paths the kernel has not failed.
func mpathActivePaths(t *testing.T, dm *devices.Device) int {
	out, err := os.ReadFile("/sys/class/block/" + dm.Name + "/dm/name")
	if err != nil {
		return -1
	}
	name := strings.TrimSpace(string(out))
	cmd, err := (execRunner{}).run(context.Background(), "dmsetup", "status", name)
	if err != nil {
		t.Logf("dmsetup status: %v", err)
		return -1
	}
	// "... 8:0 A 0 0 1 8:16 A 0 0 1": a path's number, then its state.
	f := strings.Fields(string(cmd))
	n := 0
	for i := 0; i+1 < len(f); i++ {
		if _, ok := parseMajorMinor(f[i]); ok && f[i+1] == "A" {
			n++
		}
	}
	return n
}

func parseMajorMinor(s string) (string, bool) {
	a, b, ok := strings.Cut(s, ":")
	return s, ok && isDigits(a) && isDigits(b)
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

var _ = io.Discard

// TestGuestISCSIConcurrentTargets attaches and detaches the LUNs of
// several targets behind one portal all at once, as kubelet stages and
// unstages volumes of one array in parallel: every attach and detach
// succeeds the first time, and nothing is left.
func TestGuestISCSIConcurrentTargets(t *testing.T) {
	tr := guestTransport(t, Options{})
	const n, rounds = 4, 4
	tgs := make([]*Target, n)
	iqns := make([]string, n)
	for i := range tgs {
		lt := newLIOTarget(t, "127.0.0.1:3260")
		w := lt.AddLUN(0, 16<<20)
		tgs[i] = target(t, tr, vctx(lt, 0, "wwid", w), nil)
		iqns[i] = lt.IQN
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	all := func(what string, op func(*Target) error) {
		t.Helper()
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i, tg := range tgs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = op(tg)
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("%s of target %d: %v", what, i, err)
			}
		}
		if t.Failed() {
			t.FailNow()
		}
	}
	for r := range rounds {
		start := time.Now()
		all("attach", func(tg *Target) error { _, err := tg.Attach(ctx); return err })
		attached := time.Since(start)
		all("detach", func(tg *Target) error { return tg.Detach(ctx, nil) })
		for _, iqn := range iqns {
			assertDetached(t, iqn)
		}
		t.Logf("round %d: %d attaches at once in %v, detaches in %v", r, n, attached.Round(time.Millisecond), (time.Since(start) - attached).Round(time.Millisecond))
	}
}
