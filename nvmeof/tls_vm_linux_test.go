package nvmeof

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/keyring"
	"github.com/berth-csi/berth/internal/nvmefabrics"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// The TLS tests run the target and the node in two guests on a private
// link, so that each has its own .nvme keyring (the target's keys come
// from nvme-cli, the node's from berth) and the link carries the
// traffic a capture on the node's eth0 sees.
const (
	tlsTargetIP = "192.168.78.1"
	tlsNodeIP   = "192.168.78.2"
	tlsHostID   = "5d2a7e1c-0b7e-4f0e-9a51-2c7c3b0f8e01"
	tlsHostNQN  = "nqn.2014-08.org.nvmexpress:uuid:" + tlsHostID
	// nvmet keeps DH-HMAC-CHAP keys per host, for every subsystem: the
	// case with both has a host of its own.
	tlsAuthHostID  = "6e3b8f2d-1c8f-4a1f-8b62-3d8d4c1f9f12"
	tlsAuthHostNQN = "nqn.2014-08.org.nvmexpress:uuid:" + tlsAuthHostID
	tlsNQN         = "nqn.2026-01.io.berth:tls"
	tlsAuthNQN     = "nqn.2026-01.io.berth:tls-auth"
	tlsPlainNQN    = "nqn.2026-01.io.berth:tls-plain"
)

// testSecret makes an interchange-format key (prefix "NVMeTLSkey-1:hh:"
// or "DHHC-1:hh:") of n bytes derived from seed.
func testSecret(prefix, seed string, n int) string {
	var key []byte
	for i := 0; len(key) < n; i++ {
		s := sha256.Sum256([]byte(fmt.Sprintf("%s/%d", seed, i)))
		key = append(key, s[:]...)
	}
	key = key[:n]
	b := binary.LittleEndian.AppendUint32(append([]byte(nil), key...), crc32.ChecksumIEEE(key))
	return prefix + base64.StdEncoding.EncodeToString(b) + ":"
}

var (
	tlsKey1 = testSecret("NVMeTLSkey-1:01:", "tls-key-1", 32) // the target's key of tlsNQN
	tlsKey2 = testSecret("NVMeTLSkey-1:01:", "tls-key-2", 32) // a key the target does not know
	tlsKey3 = testSecret("NVMeTLSkey-1:02:", "tls-key-3", 48) // a SHA-384 key, for the derivation
	tlsKey4 = testSecret("NVMeTLSkey-1:01:", "tls-key-4", 32) // the target's key of tlsAuthNQN
	tlsCHAP = testSecret("DHHC-1:00:", "tls-dhchap", 32)
	// The controller's key of tlsAuthNQN: the host authenticates the
	// target too.
	tlsCHAPCtrl = testSecret("DHHC-1:00:", "tls-dhchap-ctrl", 32)
	tlsPorts    = map[string]string{
		"required":     tlsTargetIP + ":4420",
		"required2":    tlsTargetIP + ":4421",
		"plain":        tlsTargetIP + ":4422",
		"auth":         tlsTargetIP + ":4423",
		"auth2":        tlsTargetIP + ":4426",
		"not required": tlsTargetIP + ":4424",
		"plainsub":     tlsTargetIP + ":4425",
	}
)

// TestVMNVMeoFTLS boots a target guest and a node guest with Debian 13's
// 6.12 kernel (NVMe/TCP TLS on both sides, CONFIG_NVME_TCP_TLS and
// CONFIG_NVME_TARGET_TCP_TLS) and tlshd 1.0.0, and runs TestTLSGuest on
// the node against nvmet ports that require TLS. BERTH_NVMEOF_RUN
// narrows the node's cases (e.g. '^TestTLSGuest$/^WrongKey$').
func TestVMNVMeoFTLS(t *testing.T) {
	link := vm.NewLink(t)
	tgt := vm.Boot(t, vm.WithName("tls-target"), vm.WithKernel("trixie"), vm.WithTestRun("^TestTLSTargetGuest$"),
		vm.WithNIC(link, tlsTargetIP+"/24"), vm.WithTimeout(10*time.Minute))
	tgt.WaitSignal("target-ready", 4*time.Minute)
	node := vm.Boot(t, vm.WithName("tls-node"), vm.WithKernel("trixie"), vm.WithTestRun(guestRun("^TestTLSGuest$")),
		vm.WithNIC(link, tlsNodeIP+"/24"), vm.WithTimeout(10*time.Minute))
	node.ReportTests(t)
	tgt.Kill()
}

// TestTLSTargetGuest is the target: nvmet subsystems on ports with and
// without TLS, the PSKs in its .nvme keyring as nvme-cli inserts them,
// its own tlshd.
func TestTLSTargetGuest(t *testing.T) {
	vm.RequireGuest(t)
	target.StartTLSHD(t)
	ns := []target.NVMeNamespace{{Size: 16 << 20}, {Size: 16 << 20}, {Size: 16 << 20}}
	tg := target.NewNVMeTarget(t, target.NVMeConfig{NQN: tlsNQN, AllowedHosts: []string{tlsHostNQN}, Namespaces: ns,
		Ports: []string{tlsPorts["required"], tlsPorts["required2"]}, TLS: "required"})
	tg.AddPort(tlsPorts["plain"])
	tg.AddPortTLS(tlsPorts["not required"], "not required")
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: tlsAuthNQN, AllowedHosts: []string{tlsAuthHostNQN}, Namespaces: ns[:1],
		Ports: []string{tlsPorts["auth"], tlsPorts["auth2"]}, TLS: "required", DHCHAP: &target.NVMeDHCHAP{Key: tlsCHAP, CtrlKey: tlsCHAPCtrl}})
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: tlsPlainNQN, Namespaces: ns[:1], Ports: []string{tlsPorts["plainsub"]}})
	target.InsertTLSKey(t, tlsHostNQN, tlsNQN, tlsKey1)
	target.InsertTLSKey(t, tlsAuthHostNQN, tlsAuthNQN, tlsKey4)
	vm.SignalHost("target-ready")
	vm.WaitHost(t, "stop")
}

// TestTLSGuest runs the node's cases in order on one boot.
func TestTLSGuest(t *testing.T) {
	vm.RequireGuest(t)
	target.StartTLSHD(t)
	ctx := guestContext(t)
	var logs bytes.Buffer
	var logMu sync.Mutex
	tr := tlsTransport(t, &logs, &logMu, tlsHostNQN, tlsHostID)
	keyTexts := []string{tlsKey1, tlsKey2, tlsKey3, tlsKey4, tlsCHAP, tlsCHAPCtrl}
	leaks := func(what string, b []byte) {
		t.Helper()
		for _, k := range keyTexts {
			payload := strings.TrimSuffix(k[strings.LastIndexByte(k[:len(k)-1], ':')+1:], ":")
			if bytes.Contains(b, []byte(k)) || bytes.Contains(b, []byte(payload[:20])) {
				t.Errorf("%s holds a key: %q", what, b)
			}
		}
	}
	defer func() {
		logMu.Lock()
		leaks("the log", logs.Bytes())
		logMu.Unlock()
	}()
	vc := func(port string, kv ...string) map[string]string {
		host, p, _ := net.SplitHostPort(tlsPorts[port])
		m := map[string]string{"nqn": tlsNQN, "nsid": "1", "traddr": host, "trsvcid": p, "tls": "true"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	parse := func(vc, secrets map[string]string) *Target {
		t.Helper()
		tg, err := tr.Parse(vc, secrets)
		if err != nil {
			t.Fatalf("Parse: %v", err)
		}
		return tg
	}
	secrets1 := map[string]string{SecretTLSKey: tlsKey1}

	t.Run("OnePath", func(t *testing.T) {
		procs := sampleKeys(keyTexts)
		tg := parse(vc("required"), secrets1)
		var tlsTimes, plainTimes []time.Duration
		for i := 0; i < 3; i++ {
			t0 := time.Now()
			dev, err := tg.Attach(ctx)
			if err != nil {
				t.Fatalf("Attach: %v", err)
			}
			tlsTimes = append(tlsTimes, time.Since(t0))
			cs := wantControllers(t, tlsNQN, 1)
			key := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN)
			if key == 0 {
				t.Fatal("no key of berth's in the keyring while the volume is attached")
			}
			if got, _ := (sysTree{}).readTLSKey(cs[0].Name); got != key {
				t.Fatalf("controller %s: tls_key %08x, want berth's key %08x", cs[0].Name, got, key)
			}
			if i == 0 {
				seen := captureWrite(t, dev.Path)
				if seen {
					t.Error("the marker written to a TLS volume showed in clear on the link")
				}
			}
			if err := tg.Detach(ctx, nil); err != nil {
				t.Fatal(err)
			}
			wantControllers(t, tlsNQN, 0)
			if k := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN); k != 0 {
				t.Errorf("berth's key %08x is still in the keyring after the last volume was detached", k)
			}
		}
		procs.check(t)
		// The same volume without TLS, for the figures and for the
		// capture that must see the marker.
		pv := parse(map[string]string{"nqn": tlsPlainNQN, "nsid": "1", "traddr": tlsTargetIP, "trsvcid": "4425"}, nil)
		for i := 0; i < 3; i++ {
			t0 := time.Now()
			dev, err := pv.Attach(ctx)
			if err != nil {
				t.Fatalf("Attach without TLS: %v", err)
			}
			plainTimes = append(plainTimes, time.Since(t0))
			if i == 0 && !captureWrite(t, dev.Path) {
				t.Error("the capture did not see the marker written to a volume without TLS: it cannot tell")
			}
			if err := pv.Detach(ctx, nil); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("attach times: TLS %v, without TLS %v", tlsTimes, plainTimes)
	})

	t.Run("TwoPaths", func(t *testing.T) {
		tg := parse(vc("required", "targets", tlsPorts["required"]+","+tlsPorts["required2"]), secrets1)
		if _, err := tg.Attach(ctx); err != nil {
			t.Fatal(err)
		}
		cs := wantControllers(t, tlsNQN, 2)
		key := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN)
		for _, c := range cs {
			if got, _ := (sysTree{}).readTLSKey(c.Name); got != key || key == 0 {
				t.Errorf("controller %s: tls_key %08x, want berth's key %08x", c.Name, got, key)
			}
		}
		// A second volume of the subsystem with the same PSK reuses
		// both controllers; while it is staged, the first one's
		// unstage keeps them and the key.
		var staged stagedList
		tr := tlsTransport(t, &logs, &logMu, tlsHostNQN, tlsHostID, &staged)
		vc1 := vc("required", "targets", tlsPorts["required"]+","+tlsPorts["required2"])
		vc2 := vc("required", "targets", tlsPorts["required"]+","+tlsPorts["required2"], "nsid", "2")
		staged.set(vc1, vc2)
		second, err := tr.Parse(vc2, secrets1)
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, second)
		if again := wantControllers(t, tlsNQN, 2); again[0].Name != cs[0].Name && again[0].Name != cs[1].Name {
			t.Errorf("the second volume did not reuse the controllers: %+v, were %+v", again, cs)
		}
		first, err := tr.Parse(vc1, nil)
		if err != nil {
			t.Fatal(err)
		}
		staged.set(vc2)
		if err := first.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, tlsNQN, 2)
		if k := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN); k != key {
			t.Errorf("berth's key is %08x after the first volume's unstage, want %08x kept for the second", k, key)
		}
		staged.set()
		if err := second.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, tlsNQN, 0)
		if k := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN); k != 0 {
			t.Errorf("berth's key %08x is left after the last unstage", k)
		}
	})

	// TLS and bidirectional DH-HMAC-CHAP on both paths: every
	// controller authenticated both ways, inside TLS with berth's key.
	t.Run("WithDHCHAP", func(t *testing.T) {
		procs := sampleKeys(keyTexts)
		tr := tlsTransport(t, &logs, &logMu, tlsAuthHostNQN, tlsAuthHostID)
		tg, err := tr.Parse(vc("auth", "nqn", tlsAuthNQN, "targets", tlsPorts["auth"]+","+tlsPorts["auth2"]),
			map[string]string{SecretTLSKey: tlsKey4, SecretDHCHAPKey: tlsCHAP, SecretDHCHAPCtrlKey: tlsCHAPCtrl})
		if err != nil {
			t.Fatal(err)
		}
		dev := mustAttach(t, ctx, tg)
		cs := wantControllers(t, tlsAuthNQN, 2)
		key := berthKey(t, "NVMe0R01 "+tlsAuthHostNQN+" "+tlsAuthNQN)
		for _, c := range cs {
			ca, err := (sysTree{}).readCtrlAuth(c.Name)
			if err != nil || ca.host == "" || ca.ctrl == "" {
				t.Errorf("controller %s (%v): not authenticated both ways: %s (%v)", c.Name, c.Address, ca.describe(), err)
			}
			if got, _ := (sysTree{}).readTLSKey(c.Name); got == 0 || got != key {
				t.Errorf("controller %s: tls_key %08x, want berth's key %08x", c.Name, got, key)
			}
		}
		if captureWrite(t, dev.Path) {
			t.Error("the marker written to a TLS volume with DH-HMAC-CHAP showed in clear on the link")
		}
		procs.check(t)
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, tlsAuthNQN, 0)
	})

	// nvme-cli inserts the keys berth derives, and a volume without a
	// PSK of its own uses the operator's key.
	t.Run("OperatorKey", func(t *testing.T) {
		nvme, err := findKeyring(".nvme")
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{tlsKey1, tlsKey3} {
			for _, host := range []string{tlsHostNQN, "nqn.2026-01.io.berth:host-x"} {
				target.InsertTLSKey(t, host, tlsNQN, k)
				pk, err := ParseTLSKey(SecretTLSKey, k)
				if err != nil {
					t.Fatal(err)
				}
				want, err := pk.Derive(host, tlsNQN)
				if err != nil {
					t.Fatal(err)
				}
				id := pk.TLSIdentity(host, tlsNQN)
				keyring.Possess(nvme, func(p keyring.Possessor) error {
					keys, err := p.Links()
					for _, key := range keys {
						if key.Description != id {
							continue
						}
						got, err := p.Read(key.Serial)
						if err != nil {
							t.Fatal(err)
						}
						t.Logf("nvme-cli inserted %q for %s: %x", id, k, got)
						if !bytes.Equal(got, want) {
							t.Errorf("berth derives %x, nvme-cli %x", want, got)
						}
						return nil
					}
					t.Errorf("nvme-cli inserted no key %q (%v)", id, err)
					return err
				})
			}
		}
		defer keyring.Possess(nvme, func(p keyring.Possessor) error {
			keys, _ := p.Links()
			for _, k := range keys {
				if k.Type == "psk" {
					p.Unlink(k.Serial)
				}
			}
			return nil
		})
		// The kernel's pick for the host and subsystem: SHA-384's.
		tg := parse(vc("required"), nil)
		_, err = tg.Attach(ctx)
		t.Logf("with the operator's SHA-384 key (the target has the SHA-256 one): %v", err)
		if err == nil {
			t.Error("Attach succeeded with a key the target does not have")
			tg.Detach(ctx, nil)
		}
		named := parse(vc("required", "tlsKeyName", "NVMe0R01 "+tlsHostNQN+" "+tlsNQN), nil)
		mustAttach(t, ctx, named)
		cs := wantControllers(t, tlsNQN, 1)
		if got, _ := (sysTree{}).readTLSKey(cs[0].Name); got == 0 {
			t.Errorf("controller %s without TLS", cs[0].Name)
		}
		if err := named.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("ReuseRefused", func(t *testing.T) {
		plain := parse(vc("not required", "tls", "false", "nsid", "2"), nil)
		mustAttach(t, ctx, plain)
		before := wantControllers(t, tlsNQN, 1)
		tg := parse(vc("not required", "nsid", "3"), secrets1)
		_, err := tg.Attach(ctx)
		t.Logf("TLS volume next to a controller without TLS: %v", err)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), before[0].Name) {
			t.Errorf("Attach: %v, want FailedPrecondition naming %s", err, before[0].Name)
		}
		after := wantControllers(t, tlsNQN, 1)
		if after[0].Name != before[0].Name {
			t.Errorf("the other volume's controller changed: %+v", after)
		}
		if err := plain.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}

		// A TLS controller and a volume of the subsystem with another
		// PSK: refused, and the controller's key stays as it was.
		first := parse(vc("required", "nsid", "2"), secrets1)
		mustAttach(t, ctx, first)
		cs := wantControllers(t, tlsNQN, 1)
		key := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN)
		other := parse(vc("required", "nsid", "3"), map[string]string{SecretTLSKey: tlsKey2})
		_, err = other.Attach(ctx)
		t.Logf("a volume with another PSK next to a TLS controller: %v", err)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), cs[0].Name) {
			t.Errorf("Attach: %v, want FailedPrecondition naming %s", err, cs[0].Name)
		}
		after = wantControllers(t, tlsNQN, 1)
		if after[0].Name != cs[0].Name || after[0].State != StateLive {
			t.Errorf("the other volume's controller changed: %+v, was %+v", after[0], cs[0])
		}
		if got := berthKey(t, "NVMe0R01 "+tlsHostNQN+" "+tlsNQN); got != key {
			t.Errorf("berth's key is %08x, was %08x", got, key)
		}
		// The controller still does I/O with its key: a write goes
		// through a reconnect of its queues.
		if err := os.WriteFile("/sys/class/nvme/"+cs[0].Name+"/reset_controller", []byte("1"), 0); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 30*time.Second, cs[0].Name+" live after a reset", func() bool {
			b, _ := os.ReadFile("/sys/class/nvme/" + cs[0].Name + "/state")
			return strings.TrimSpace(string(b)) == StateLive
		})
		if err := first.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
	})

	// refused stages tg, which must fail with want (the agent's code:
	// ErrFailedPrecondition is FAILED_PRECONDITION, ErrUnavailable
	// UNAVAILABLE) and a message holding every text, and leave nothing
	// connected and no key of berth's.
	refused := func(t *testing.T, tg *Target, nqn string, want error, texts ...string) {
		t.Helper()
		t0 := time.Now()
		_, err := tg.Attach(ctx)
		t.Logf("after %v: %v", time.Since(t0).Round(time.Millisecond), err)
		if err == nil {
			t.Fatal("Attach succeeded")
		}
		if !errors.Is(err, want) {
			t.Errorf("Attach: %v, want %v", err, want)
		}
		for _, text := range texts {
			if !strings.Contains(err.Error(), text) {
				t.Errorf("Attach: %v, want it to say %q", err, text)
			}
		}
		wantControllers(t, nqn, 0)
		for _, id := range []string{"NVMe0R01 " + tlsHostNQN + " " + nqn, "NVMe0R02 " + tlsHostNQN + " " + nqn} {
			if k := berthKey(t, id); k != 0 {
				t.Errorf("berth's key %08x (%s) is left in the keyring", k, id)
			}
		}
	}
	t.Run("WrongKey", func(t *testing.T) {
		// A wrong PSK is the operator's to fix: FAILED_PRECONDITION,
		// naming the identity whose PSK to compare on the target.
		refused(t, parse(vc("required"), map[string]string{SecretTLSKey: tlsKey2}), tlsNQN, errdefs.ErrFailedPrecondition,
			fmt.Sprintf("no PSK for identity %q, or another one than the volume gives", "NVMe0R01 "+tlsHostNQN+" "+tlsNQN),
			"check the target's PSK for this host and subsystem")
	})
	t.Run("NoKey", func(t *testing.T) {
		refused(t, parse(vc("required"), nil), tlsNQN, errdefs.ErrFailedPrecondition, SecretTLSKey)
	})
	t.Run("TargetWithoutTLS", func(t *testing.T) {
		refused(t, parse(vc("plain"), secrets1), tlsNQN, errdefs.ErrFailedPrecondition, "does not offer TLS")
	})
	t.Run("TargetRequiresTLS", func(t *testing.T) {
		refused(t, parse(vc("required", "tls", "false"), nil), tlsNQN, errdefs.ErrFailedPrecondition, "requires TLS")
	})
	t.Run("ConcatUnsupported", func(t *testing.T) {
		refused(t, parse(vc("required", "tlsConcat", "true"), map[string]string{SecretDHCHAPKey: tlsCHAP}), tlsNQN, errdefs.ErrUnsupported, "Linux 6.15")
	})
	t.Run("NoTLSHD", func(t *testing.T) {
		target.StopTLSHD(t)
		defer target.StartTLSHD(t)
		refused(t, parse(vc("required"), secrets1), tlsNQN, errdefs.ErrUnavailable, "tlshd")
	})
}

// tlsTransport is guestTransport with the host identity the target
// knows and a log kept for the leak check.
func tlsTransport(t *testing.T, logs *bytes.Buffer, mu *sync.Mutex, hostNQN, hostID string, staged ...*stagedList) *Transport {
	t.Helper()
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	w := lockedWriter{mu: mu, w: logs, t: t}
	var list func(context.Context) ([]map[string]string, error)
	if len(staged) > 0 {
		list = staged[0].list
	}
	tr, err := NewTransport(Options{
		Staged:           list,
		Listener:         l,
		Host:             &HostIdentity{NQN: hostNQN, ID: hostID},
		NamespaceTimeout: 10 * time.Second,
		Logger:           slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
	t  *testing.T
}

func (w lockedWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	w.w.Write(b)
	w.mu.Unlock()
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// findKeyring finds a keyring of the guest by name.
func findKeyring(name string) (int, error) {
	keys, err := keyring.List()
	if err != nil {
		return 0, err
	}
	return keyring.Find(keys, name)
}

// berthKey returns the serial of berth's key with this description, 0
// for none.
func berthKey(t *testing.T, desc string) int {
	t.Helper()
	nvme, err := findKeyring(".nvme")
	if err != nil {
		t.Fatal(err)
	}
	var id int
	err = keyring.Possess(nvme, func(p keyring.Possessor) error {
		ring, err := p.Search("keyring", berthKeyring)
		if err != nil || ring == 0 {
			return err
		}
		keys, err := p.Sub(ring).Links()
		for _, k := range keys {
			if k.Type == "psk" && k.Description == desc {
				id = k.Serial
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// keySampler reads every process's argv and environment until stopped
// and keeps those that hold a key (as agent's LUKS test does).
type keySampler struct {
	keys    [][]byte
	stop    chan struct{}
	done    chan struct{}
	mu      sync.Mutex
	leaks   []string
	samples int
}

func sampleKeys(keys []string) *keySampler {
	s := &keySampler{stop: make(chan struct{}), done: make(chan struct{})}
	for _, k := range keys {
		s.keys = append(s.keys, []byte(k), []byte(k[16:36]))
	}
	go func() {
		defer close(s.done)
		for {
			select {
			case <-s.stop:
				return
			default:
			}
			ents, _ := os.ReadDir("/proc")
			for _, e := range ents {
				if e.Name()[0] < '0' || e.Name()[0] > '9' {
					continue
				}
				for _, f := range []string{"cmdline", "environ"} {
					b, err := os.ReadFile("/proc/" + e.Name() + "/" + f)
					if err != nil {
						continue
					}
					for _, k := range s.keys {
						if bytes.Contains(b, k) {
							s.mu.Lock()
							s.leaks = append(s.leaks, e.Name()+"/"+f)
							s.mu.Unlock()
						}
					}
				}
			}
			s.mu.Lock()
			s.samples++
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *keySampler) check(t *testing.T) {
	t.Helper()
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	t.Logf("sampled every process's argv and environment %d times during the stages", s.samples)
	if s.samples < 2 {
		t.Error("the sampler barely ran: the check proves nothing")
	}
	if len(s.leaks) > 0 {
		t.Errorf("a key showed in a process's argv or environment: %q", s.leaks)
	}
}

// captureWrite writes a marker block to dev with O_DIRECT while an
// AF_PACKET socket captures eth0, and reports whether the marker showed
// in the captured frames. It fails the test when the capture saw too
// little traffic to tell.
func captureWrite(t *testing.T, dev string) bool {
	t.Helper()
	ifi, err := net.InterfaceByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	proto := int(htons(unix.ETH_P_ALL))
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		t.Fatalf("AF_PACKET socket: %v", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
		t.Fatal(err)
	}
	tv := unix.NsecToTimeval(int64(200 * time.Millisecond))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)

	marker := []byte(hex.EncodeToString([]byte(fmt.Sprintf("berth-marker-%d", time.Now().UnixNano()))))
	var captured bytes.Buffer
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			n, _, err := unix.Recvfrom(fd, buf, 0)
			if n > 0 {
				captured.Write(buf[:n])
			}
			select {
			case <-stop:
				if err != nil {
					return
				}
			default:
			}
		}
	}()
	block := make([]byte, 8192)
	// An aligned buffer for O_DIRECT: a page of an mmap.
	mem, err := unix.Mmap(-1, 0, len(block), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	for i := 0; i+len(marker) <= len(mem); i += len(marker) {
		copy(mem[i:], marker)
	}
	f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(mem, 0); err != nil {
		t.Fatalf("write %s: %v", dev, err)
	}
	f.Close()
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-done
	if captured.Len() < len(mem) {
		t.Fatalf("captured %d bytes on eth0 during a write of %d: the capture cannot tell", captured.Len(), len(mem))
	}
	seen := bytes.Contains(captured.Bytes(), marker)
	t.Logf("captured %d bytes on eth0 while writing %d bytes of marker to %s: marker seen %v", captured.Len(), len(mem), dev, seen)
	return seen
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// TestGuestTLSNoKernel stages a TLS volume on a kernel without NVMe/TCP
// TLS (the default guest: Debian 12's 6.1 has no CONFIG_NVME_TCP_TLS):
// the stage fails before any connect, naming the kernel option, and
// nothing is connected. It fails on a kernel with TLS, where
// TestVMNVMeoFTLS runs the TLS cases.
func TestGuestTLSNoKernel(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	tr := guestTransport(t, nil)
	target.LoadModules(t, "nvme_tcp")
	opts, err := nvmefabrics.Options(DefaultFabricsDevice)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel %s: connect options %s", os.Getenv("BERTH_VM_KERNEL"), opts)
	if tr.tlsSupported(false) == nil {
		t.Fatalf("this kernel has NVMe/TCP TLS: the test is for a kernel without it; TestVMNVMeoFTLS runs the TLS cases")
	}
	nqn := "nqn.2026-01.io.berth:notls"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4472"}})
	tg, err := tr.Parse(map[string]string{"nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4472", "tls": "true"},
		map[string]string{SecretTLSKey: tlsKey1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = tg.Attach(ctx)
	t.Logf("attach: %v", err)
	if !errors.Is(err, errdefs.ErrUnsupported) || !strings.Contains(err.Error(), "CONFIG_NVME_TCP_TLS") {
		t.Errorf("Attach: %v, want ErrUnsupported naming CONFIG_NVME_TCP_TLS", err)
	}
	wantControllers(t, nqn, 0)
}

// Secure channel concatenation: the TLS PSK derived from the
// DH-HMAC-CHAP exchange (Linux 6.15 and later, host and target).
const (
	tlsConcatHostID  = "7f4c9a3e-2d9f-4b2a-9c73-4e9e5d2a0a23"
	tlsConcatHostNQN = "nqn.2014-08.org.nvmexpress:uuid:" + tlsConcatHostID
	tlsConcatNQN     = "nqn.2026-01.io.berth:tls-concat"
)

var (
	tlsConcatCHAP  = testSecret("DHHC-1:00:", "tls-concat-dhchap", 32)
	tlsConcatCHAP2 = testSecret("DHHC-1:00:", "tls-concat-dhchap-2", 32) // a key the target does not know
	// nvmet ports for concatenation offer TLS and let the connect start
	// in clear ("not required"); "required" and "plain" are the two
	// ways to get the port wrong.
	tlsConcatPorts = map[string]string{
		"concat":   tlsTargetIP + ":4430",
		"concat2":  tlsTargetIP + ":4431",
		"required": tlsTargetIP + ":4432",
		"plain":    tlsTargetIP + ":4433",
	}
)

// TestVMNVMeoFTLSConcat boots a target and a node guest with Debian 13
// backports' 7.3 kernel, whose host and nvmet have secure channel
// concatenation, and tlshd 1.0.0, and runs TestTLSConcatGuest on the
// node. BERTH_NVMEOF_RUN narrows the node's cases.
func TestVMNVMeoFTLSConcat(t *testing.T) {
	link := vm.NewLink(t)
	common := []vm.Option{vm.WithKernel("trixie-backports"), vm.WithTimeout(10 * time.Minute)}
	tgt := vm.Boot(t, append(common, vm.WithName("tls-concat-target"), vm.WithTestRun("^TestTLSConcatTargetGuest$"),
		vm.WithNIC(link, tlsTargetIP+"/24"))...)
	tgt.WaitSignal("target-ready", 4*time.Minute)
	node := vm.Boot(t, append(common, vm.WithName("tls-concat-node"), vm.WithTestRun(guestRun("^TestTLSConcatGuest$")),
		vm.WithNIC(link, tlsNodeIP+"/24"))...)
	node.ReportTests(t)
	tgt.Kill()
}

// TestTLSConcatTargetGuest is the target: a subsystem whose host
// authenticates with DH-HMAC-CHAP and a DH group (the PSK is derived
// from the DH exchange), on two ports for concatenation, one that
// requires TLS and one without. No PSK: nvmet derives it.
func TestTLSConcatTargetGuest(t *testing.T) {
	vm.RequireGuest(t)
	target.StartTLSHD(t)
	ns := []target.NVMeNamespace{{Size: 16 << 20}, {Size: 16 << 20}}
	tg := target.NewNVMeTarget(t, target.NVMeConfig{NQN: tlsConcatNQN, AllowedHosts: []string{tlsConcatHostNQN}, Namespaces: ns,
		Ports: []string{tlsConcatPorts["concat"], tlsConcatPorts["concat2"]}, TLS: "not required",
		DHCHAP: &target.NVMeDHCHAP{Key: tlsConcatCHAP, DHGroup: "ffdhe2048"}})
	tg.AddPortTLS(tlsConcatPorts["required"], "required")
	tg.AddPort(tlsConcatPorts["plain"])
	vm.SignalHost("target-ready")
	vm.WaitHost(t, "stop")
}

// TestTLSConcatGuest runs the node's concatenation cases in order.
func TestTLSConcatGuest(t *testing.T) {
	vm.RequireGuest(t)
	target.StartTLSHD(t)
	ctx := guestContext(t)
	var logs bytes.Buffer
	var logMu sync.Mutex
	tr := tlsTransport(t, &logs, &logMu, tlsConcatHostNQN, tlsConcatHostID)
	keyTexts := []string{tlsConcatCHAP, tlsConcatCHAP2}
	defer func() {
		logMu.Lock()
		defer logMu.Unlock()
		for _, k := range keyTexts {
			if bytes.Contains(logs.Bytes(), []byte(k[10:40])) {
				t.Errorf("the log holds a DH-HMAC-CHAP key")
			}
		}
	}()
	vc := func(ports ...string) map[string]string {
		var addrs []string
		for _, p := range ports {
			addrs = append(addrs, tlsConcatPorts[p])
		}
		host, p, _ := net.SplitHostPort(addrs[0])
		return map[string]string{"nqn": tlsConcatNQN, "nsid": "1", "traddr": host, "trsvcid": p, "tls": "true", "tlsConcat": "true",
			"targets": strings.Join(addrs, ",")}
	}
	secrets := map[string]string{SecretDHCHAPKey: tlsConcatCHAP}
	parse := func(vc, secrets map[string]string) *Target {
		t.Helper()
		tg, err := tr.Parse(vc, secrets)
		if err != nil {
			t.Fatalf("Parse: %v", err)
		}
		return tg
	}
	// generated returns the serials of the PSKs the kernel generated
	// for the host and subsystem that are linked in .nvme. (/proc/keys
	// lists an unlinked key until the kernel's key collector runs.)
	generated := func(t *testing.T) map[int]bool {
		t.Helper()
		nvme, err := findKeyring(".nvme")
		if err != nil {
			t.Fatal(err)
		}
		ids := map[int]bool{}
		err = keyring.Possess(nvme, func(p keyring.Possessor) error {
			keys, err := p.Links()
			for _, k := range keys {
				if k.Type == "psk" && generatedPSKFor(k.Description, tlsConcatHostNQN, tlsConcatNQN) {
					ids[k.Serial] = true
				}
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	// concatenated checks that every controller of the subsystem is
	// authenticated and encrypted with a PSK the kernel generated.
	concatenated := func(t *testing.T, n int) []Controller {
		t.Helper()
		cs := wantControllers(t, tlsConcatNQN, n)
		gen := generated(t)
		for _, c := range cs {
			ca, err := (sysTree{}).readCtrlAuth(c.Name)
			if err != nil || ca.host == "" {
				t.Errorf("controller %s: not authenticated: %s (%v)", c.Name, ca.describe(), err)
			}
			if got, _ := (sysTree{}).readTLSKey(c.Name); got == 0 || !gen[got] {
				t.Errorf("controller %s: tls_key %08x, want one of the generated PSKs %v", c.Name, got, gen)
			}
		}
		return cs
	}
	// gone checks that nothing of the subsystem is left: no controller,
	// no generated PSK.
	gone := func(t *testing.T) {
		t.Helper()
		wantControllers(t, tlsConcatNQN, 0)
		if gen := generated(t); len(gen) > 0 {
			t.Errorf("generated PSKs left in .nvme after the last controller went: %v", gen)
		}
	}

	t.Run("OnePath", func(t *testing.T) {
		procs := sampleKeys(keyTexts)
		tg := parse(vc("concat"), secrets)
		t0 := time.Now()
		dev := mustAttach(t, ctx, tg)
		t.Logf("attach with concatenation: %v", time.Since(t0).Round(time.Millisecond))
		procs.check(t)
		cs := concatenated(t, 1)
		before, _ := (sysTree{}).readTLSKey(cs[0].Name)
		if captureWrite(t, dev.Path) {
			t.Error("the marker written to a volume with concatenation showed in clear on the link")
		}
		// A reset authenticates again, with a new PSK; the kernel
		// revokes the earlier one (7.3).
		if err := os.WriteFile("/sys/class/nvme/"+cs[0].Name+"/reset_controller", []byte("1"), 0); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 30*time.Second, cs[0].Name+" live after a reset", func() bool {
			b, _ := os.ReadFile("/sys/class/nvme/" + cs[0].Name + "/state")
			return strings.TrimSpace(string(b)) == StateLive
		})
		concatenated(t, 1)
		after, _ := (sysTree{}).readTLSKey(cs[0].Name)
		gen := generated(t)
		t.Logf("tls_key %08x before the reset, %08x after; generated PSKs in .nvme %v", before, after, gen)
		if after == before || gen[before] {
			t.Errorf("after a reset: tls_key %08x (was %08x), generated PSKs in .nvme %v: want a new key and the old one gone", after, before, gen)
		}
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		gone(t)
	})

	t.Run("TwoPaths", func(t *testing.T) {
		// A second volume of the subsystem reuses both controllers;
		// the first one's unstage keeps them for it.
		var staged stagedList
		tr := tlsTransport(t, &logs, &logMu, tlsConcatHostNQN, tlsConcatHostID, &staged)
		vc1, vc2 := vc("concat", "concat2"), vc("concat", "concat2")
		vc2["nsid"] = "2"
		staged.set(vc1, vc2)
		first, err := tr.Parse(vc1, secrets)
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, first)
		cs := concatenated(t, 2)
		second, err := tr.Parse(vc2, secrets)
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, second)
		if again := concatenated(t, 2); again[0].Name != cs[0].Name && again[0].Name != cs[1].Name {
			t.Errorf("the second volume did not reuse the controllers: %+v, were %+v", again, cs)
		}
		staged.set(vc2)
		if err := first.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		concatenated(t, 2)
		staged.set()
		if err := second.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		gone(t)
	})

	refused := func(t *testing.T, tg *Target, want error, texts ...string) error {
		t.Helper()
		t0 := time.Now()
		_, err := tg.Attach(ctx)
		t.Logf("after %v: %v", time.Since(t0).Round(time.Millisecond), err)
		if err == nil {
			t.Fatal("Attach succeeded")
		}
		if want != nil && !errors.Is(err, want) {
			t.Errorf("Attach: %v, want %v", err, want)
		}
		for _, text := range texts {
			if !strings.Contains(err.Error(), text) {
				t.Errorf("Attach: %v, want it to say %q", err, text)
			}
		}
		return err
	}
	t.Run("ReuseRefused", func(t *testing.T) {
		// The same keys without TLS: a controller the volume with
		// concatenation must not use.
		plain := parse(map[string]string{"nqn": tlsConcatNQN, "nsid": "2", "traddr": tlsTargetIP, "trsvcid": "4430"}, secrets)
		mustAttach(t, ctx, plain)
		cs := wantControllers(t, tlsConcatNQN, 1)
		refused(t, parse(vc("concat"), secrets), errdefs.ErrFailedPrecondition, cs[0].Name, "without TLS")
		if after := wantControllers(t, tlsConcatNQN, 1); after[0].Name != cs[0].Name {
			t.Errorf("the other volume's controller changed: %+v", after)
		}
		if err := plain.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		gone(t)
	})
	t.Run("WrongKey", func(t *testing.T) {
		keyRejected(t, refused(t, parse(vc("concat"), map[string]string{SecretDHCHAPKey: tlsConcatCHAP2}), nil))
		gone(t)
	})
	t.Run("NoDHCHAPKey", func(t *testing.T) {
		refused(t, parse(vc("concat"), nil), errdefs.ErrInvalidArgument, SecretDHCHAPKey)
		gone(t)
	})
	t.Run("PortRequiresTLS", func(t *testing.T) {
		refused(t, parse(vc("required"), secrets), errdefs.ErrFailedPrecondition, `addr_treq "not required"`)
		gone(t)
	})
	t.Run("TargetWithoutTLS", func(t *testing.T) {
		refused(t, parse(vc("plain"), secrets), errdefs.ErrFailedPrecondition, "the DH-HMAC-CHAP authentication passed, but the TLS handshake")
		gone(t)
	})
}
