package nvmeof

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// kernelAuth reports whether the guest kernel has NVMe in-band
// authentication on the host side (a fabrics controller shows
// dhchap_secret) and on the target side (an nvmet host has dhchap_key).
// The probe connects to a target that asks for no authentication.
func kernelAuth(t *testing.T, ctx context.Context, hostNQN, hostID string) (host, tgt bool) {
	t.Helper()
	nqn := "nqn.2026-01.io.berth:authprobe"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4469"}, AllowedHosts: []string{hostNQN}})
	_, err := os.Stat(filepath.Join("/sys/kernel/config/nvmet/hosts", hostNQN, "dhchap_key"))
	tgt = err == nil
	o := ConnectOptions{Transport: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4469", NQN: nqn, HostNQN: hostNQN, HostID: hostID}
	s, err := o.Encode()
	if err != nil {
		t.Fatal(err)
	}
	inst, err := fabricsConnect(ctx, DefaultFabricsDevice, s)
	if err != nil {
		t.Fatalf("probe connect: %v", err)
	}
	ca, err := sysTree{}.readCtrlAuth("nvme" + itoa(inst))
	if err != nil {
		t.Fatal(err)
	}
	if err := (sysTree{}).deleteController(nqn, "nvme"+itoa(inst), func(*Controller) bool { return true }); err != nil {
		t.Fatal(err)
	}
	return ca.supported, tgt
}

// noKeyIn fails when s holds any of keys (or a long part of one).
func noKeyIn(t *testing.T, what, s string, keys ...string) {
	t.Helper()
	for _, k := range keys {
		if strings.Contains(s, k[10:30]) {
			t.Errorf("%s holds a DH-HMAC-CHAP key: %q", what, s)
		}
	}
}

// TestVMNVMeoFAuth boots Debian 13's 6.12 cloud kernel, built with NVMe
// in-band authentication on both sides (CONFIG_NVME_HOST_AUTH,
// CONFIG_NVME_TARGET_AUTH), and runs the TestAuthGuest* tests of this
// package there. The default guest's 6.1 kernel has neither.
func TestVMNVMeoFAuth(t *testing.T) {
	vm.RunGuestTests(t,
		vm.WithKernel("trixie"),
		vm.WithTestRun(guestRun("^TestAuthGuest")),
		vm.WithTimeout(12*time.Minute),
	)
}

// dhchapKeys makes four keys as nvme-cli makes them, one of each hash.
func dhchapKeys(t *testing.T, hostNQN string) (k1, k2, c1, c2 string) {
	t.Helper()
	var keys []string
	for _, h := range []string{"1", "2", "3", "0"} {
		out, err := exec.Command("nvme", "gen-dhchap-key", "--hmac="+h, "--nqn", hostNQN).Output()
		if err != nil {
			t.Fatalf("nvme gen-dhchap-key: %v", err)
		}
		k := strings.TrimSpace(string(out))
		if _, err := ParseDHCHAPKey(SecretDHCHAPKey, k); err != nil {
			t.Fatalf("nvme-cli's key: %v", err)
		}
		keys = append(keys, k)
	}
	return keys[0], keys[1], keys[2], keys[3]
}

// TestGuestDHCHAPNoKernelAuth attaches volumes with DH-HMAC-CHAP keys on
// a kernel without in-band authentication (the default guest: Debian
// 12's 6.1 kernels are built without CONFIG_NVME_AUTH and
// CONFIG_NVME_TARGET_AUTH). Such a kernel takes the keys and connects
// without authenticating when the target asks for none; berth must
// refuse the volume and leave nothing connected. It fails on a kernel
// with in-band authentication: TestAuthGuestDHCHAP covers that one.
func TestGuestDHCHAPNoKernelAuth(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	tr := guestTransport(t, nil)
	host, err := tr.HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	k1, _, c1, _ := dhchapKeys(t, host.NQN)
	if hostAuth, targetAuth := kernelAuth(t, ctx, host.NQN, host.ID); hostAuth {
		t.Fatalf("kernel %s has in-band authentication (host side %v, target side %v): this test is for a kernel without it; TestVMNVMeoFAuth runs the authentication cases",
			os.Getenv("BERTH_VM_KERNEL"), hostAuth, targetAuth)
	}

	nqn := "nqn.2026-01.io.berth:noauth"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4470"}, AllowedHosts: []string{host.NQN},
		Namespaces: []target.NVMeNamespace{{Size: 16 << 20}, {Size: 16 << 20}}})
	vc := map[string]string{"nqn": nqn, "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4470"}
	// No other controller: berth connects, finds no key
	// attribute, and removes the controller again.
	tg, err := tr.Parse(vc, map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c1})
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	_, err = tg.Attach(ctx)
	if !errors.Is(err, errdefs.ErrUnsupported) || !strings.Contains(err.Error(), "in-band authentication") {
		t.Fatalf("Attach with keys: %v, want ErrUnsupported naming in-band authentication", err)
	}
	t.Logf("attach with keys: %v", err)
	noKeyIn(t, "error", err.Error(), k1, c1)
	wantControllers(t, nqn, 0)

	// A volume without keys connects; a volume with keys is
	// then refused before any connect, and does not take
	// over the unauthenticated controller.
	plain, err := tr.Parse(vc, nil)
	if err != nil {
		t.Fatal(err)
	}
	mustAttach(t, ctx, plain)
	before := wantControllers(t, nqn, 1)
	vc2 := map[string]string{"nqn": nqn, "nsid": "2", "traddr": "127.0.0.1", "trsvcid": "4470"}
	keyed, err := tr.Parse(vc2, map[string]string{SecretDHCHAPKey: k1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := keyed.Attach(ctx); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Fatalf("Attach with keys next to an unauthenticated controller: %v, want ErrUnsupported", err)
	}
	after := wantControllers(t, nqn, 1)
	if after[0].Name != before[0].Name || after[0].State != StateLive {
		t.Errorf("the other volume's controller changed: %+v, was %+v", after[0], before[0])
	}
	if err := plain.Detach(ctx, nil); err != nil {
		t.Fatal(err)
	}
	wantControllers(t, nqn, 0)
}

// TestAuthGuestDHCHAP attaches volumes with DH-HMAC-CHAP keys against
// the kernel's target asking for them, on a kernel with in-band
// authentication on both sides (TestVMNVMeoFAuth's guest). It fails on
// a kernel without it.
func TestAuthGuestDHCHAP(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	tr := guestTransport(t, nil)
	host, err := tr.HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	k1, k2, c1, c2 := dhchapKeys(t, host.NQN)
	hostAuth, targetAuth := kernelAuth(t, ctx, host.NQN, host.ID)
	t.Logf("kernel %s: host side in-band authentication %v, target side %v", os.Getenv("BERTH_VM_KERNEL"), hostAuth, targetAuth)
	if !hostAuth || !targetAuth {
		t.Fatalf("the guest kernel lacks NVMe in-band authentication (host side %v, target side %v: CONFIG_NVME_AUTH/CONFIG_NVME_HOST_AUTH, CONFIG_NVME_TARGET_AUTH); the DH-HMAC-CHAP cases need a guest kernel with both (vm.WithKernel)", hostAuth, targetAuth)
	}
	guestDHCHAPAuth(t, tr, host.NQN, k1, k2, c1, c2)
}

// keyRejected checks the error of a connect whose keys the target (or
// the host) rejected. 6.12 answers EKEYREJECTED: PermissionDenied.
// Measured on 6.12.117, about one failed authentication in three: the
// target drops the connection ("nvmet: ctrl N fatal error occurred")
// while the host still waits for its authentication reply; the host's
// admin command times out after 60 s (nvme_core.admin_timeout,
// "failed to send request -32") and the connect fails with a host path
// error, EIO, which berth cannot tell from a subsystem that does not
// allow the host: FailedPrecondition, naming DH-HMAC-CHAP among the
// causes.
func keyRejected(t *testing.T, err error) {
	t.Helper()
	if errors.Is(err, errdefs.ErrPermissionDenied) {
		return
	}
	if !strings.Contains(err.Error(), "input/output error") || !strings.Contains(err.Error(), "DH-HMAC-CHAP") {
		t.Errorf("a rejected key: %v, want PermissionDenied (EKEYREJECTED), or FailedPrecondition naming DH-HMAC-CHAP after the kernel's EIO", err)
	}
}

// guestDHCHAPAuth runs the cases that need in-band authentication in the
// kernel, both host and target side.
func guestDHCHAPAuth(t *testing.T, tr *Transport, hostNQN string, k1, k2, c1, c2 string) {

	nqn := "nqn.2026-01.io.berth:dhchap"
	port := "127.0.0.1:4471"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{port}, AllowedHosts: []string{hostNQN},
		Namespaces: []target.NVMeNamespace{{Size: 16 << 20}, {Size: 16 << 20}},
		DHCHAP:     &target.NVMeDHCHAP{Key: k1}})
	vc := func(nsid string) map[string]string {
		return map[string]string{"nqn": nqn, "nsid": nsid, "traddr": "127.0.0.1", "trsvcid": "4471"}
	}
	attachFails := func(t *testing.T, nsid string, secrets map[string]string, want ...error) error {
		t.Helper()
		tg, err := tr.Parse(vc(nsid), secrets)
		if err != nil {
			t.Fatalf("Parse: %v", err)
		}
		ctx := guestContext(t)
		start := time.Now()
		dev, err := tg.Attach(ctx)
		if err == nil {
			tg.Detach(ctx, nil)
			t.Fatalf("attached %s", dev)
		}
		ok := false
		for _, w := range want {
			ok = ok || errors.Is(err, w)
		}
		if !ok {
			t.Errorf("Attach: %v, want one of %v", err, want)
		}
		t.Logf("refused in %v: %v", time.Since(start).Round(time.Millisecond), err)
		noKeyIn(t, "error", err.Error(), k1, k2, c1, c2)
		return err
	}

	t.Run("unidirectional", func(t *testing.T) {
		ctx := guestContext(t)
		tg, err := tr.Parse(vc("1"), map[string]string{SecretDHCHAPKey: k1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		cs := wantControllers(t, nqn, 1)
		ca, err := sysTree{}.readCtrlAuth(cs[0].Name)
		if err != nil || !ca.supported || ca.host != k1 || ca.ctrl != "" {
			t.Errorf("controller keys: supported %v, host key matches %v, controller key set %v, %v", ca.supported, ca.host == k1, ca.ctrl != "", err)
		}
		if abnormal, msg := tg.Health(ctx); abnormal {
			t.Errorf("Health: %s", msg)
		}
		// Another volume of the subsystem must name the same key to
		// share the controller.
		attachFails(t, "2", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrFailedPrecondition)
		attachFails(t, "2", nil, errdefs.ErrFailedPrecondition)
		attachFails(t, "2", map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c1}, errdefs.ErrFailedPrecondition)
		wantControllers(t, nqn, 1)
		tg2, err := tr.Parse(vc("2"), map[string]string{SecretDHCHAPKey: k1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg2)
		wantControllers(t, nqn, 1)
		if err := tg2.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	})
	t.Run("wrong host key", func(t *testing.T) {
		keyRejected(t, attachFails(t, "1", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrPermissionDenied, errdefs.ErrFailedPrecondition))
		wantControllers(t, nqn, 0)
	})
	t.Run("no key", func(t *testing.T) {
		err := attachFails(t, "1", nil, errdefs.ErrPermissionDenied, errdefs.ErrFailedPrecondition)
		if !strings.Contains(err.Error(), "DH-HMAC-CHAP") {
			t.Errorf("the error does not mention DH-HMAC-CHAP: %v", err)
		}
		wantControllers(t, nqn, 0)
	})
	t.Run("bidirectional", func(t *testing.T) {
		ctx := guestContext(t)
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k1, CtrlKey: c1})
		tg, err := tr.Parse(vc("1"), map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		wantControllers(t, nqn, 1)
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	})
	t.Run("wrong controller key", func(t *testing.T) {
		// The target proves c1; the host expects c2 and must refuse it.
		keyRejected(t, attachFails(t, "1", map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c2}, errdefs.ErrPermissionDenied, errdefs.ErrFailedPrecondition))
		wantControllers(t, nqn, 0)
	})
	t.Run("key changed on the target while connected", func(t *testing.T) {
		ctx := guestContext(t)
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k1})
		vcr := vc("1")
		vcr["reconnectDelay"] = "1"
		tg, err := tr.Parse(vcr, map[string]string{SecretDHCHAPKey: k1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		// The target takes another key and drops the connection: every
		// reconnect with the old key fails. 6.12 either keeps
		// reconnecting (the first attempts failed on the dropped
		// connection) or deletes the controller (the attempt failed
		// authentication, a status with Do Not Retry): both seen.
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k2})
		tgt.RemovePort(port)
		tgt.AddPort(port)
		waitFor(t, 20*time.Second, "a reconnect", func() bool {
			cs := controllersOf(t, nqn)
			return len(cs) == 0 || cs[0].State != StateLive
		})
		time.Sleep(3 * time.Second) // a few reconnect attempts
		cs := controllersOf(t, nqn)
		abnormal, msg := tg.Health(ctx)
		t.Logf("controllers %d; health: %v %s", len(cs), abnormal, msg)
		if !abnormal || !strings.Contains(msg, "DH-HMAC-CHAP") {
			t.Errorf("Health = %v, %q: want the path abnormal, naming DH-HMAC-CHAP", abnormal, msg)
		}
		noKeyIn(t, "health", msg, k1, k2)
		if len(cs) > 0 {
			if cs[0].State == StateLive {
				t.Fatalf("controller %s live again with the old key", cs[0].Name)
			}
			// A re-stage with the target's new key is refused while
			// the controller holds the old one.
			attachFails(t, "1", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrFailedPrecondition)
		}
		// As the agent's unstage does: a namespace without a live
		// controller is made to fail I/O before the detach flushes it
		// (a flush would queue until the kernel deletes the controller,
		// then fail with EIO).
		if _, err := tg.StopQueueing(ctx); err != nil {
			t.Fatal(err)
		}
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
		tg2, err := tr.Parse(vc("1"), map[string]string{SecretDHCHAPKey: k2})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg2)
		if err := tg2.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("key removed on the target while connected", func(t *testing.T) {
		ctx := guestContext(t)
		// Measured on 6.12: the host authenticates only when the
		// target's connect response asks for it (AUTHREQ). A target
		// that forgets the host's keys is reconnected without any
		// authentication, controller key or not, and sysfs shows no
		// difference (the controller keeps its dhchap_secret and
		// dhchap_ctrl_secret). berth cannot tell, so the path is live
		// and Health is normal. This fails when a kernel starts to
		// refuse such a target; berth's documentation of the
		// controller key (docs/volume-context.md, doc.go) must then follow.
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k1, CtrlKey: c1})
		vcr := vc("1")
		vcr["reconnectDelay"] = "1"
		secrets := map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c1}
		tg, err := tr.Parse(vcr, secrets)
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		before := wantControllers(t, nqn, 1)
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{})
		tgt.RemovePort(port)
		tgt.AddPort(port)
		waitFor(t, 20*time.Second, "a reconnect", func() bool {
			cs := controllersOf(t, nqn)
			return len(cs) == 1 && cs[0].State != StateLive
		})
		waitFor(t, 20*time.Second, "the controller live again", func() bool {
			cs := controllersOf(t, nqn)
			return len(cs) == 1 && cs[0].State == StateLive
		})
		cs := wantControllers(t, nqn, 1)
		ca, err := sysTree{}.readCtrlAuth(cs[0].Name)
		abnormal, msg := tg.Health(ctx)
		t.Logf("reconnected without authentication: %s %s, keys kept %v %v, health: %v %s", cs[0].Name, cs[0].State, ca.host == k1, ca.ctrl == c1, abnormal, msg)
		if err != nil || cs[0].Name != before[0].Name || ca.host != k1 || ca.ctrl != c1 || abnormal {
			t.Errorf("after the reconnect without authentication: controller %s (was %s), keys kept %v %v (%v), health %v %q",
				cs[0].Name, before[0].Name, ca.host == k1, ca.ctrl == c1, err, abnormal, msg)
		}
		if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
		// The first connect is no different: keys given, none asked.
		tg, err = tr.Parse(vc("1"), secrets)
		if err != nil {
			t.Fatal(err)
		}
		dev, err := tg.Attach(ctx)
		t.Logf("attach with both keys to a target that asks for none: %v %v", dev, err)
		if err != nil {
			t.Errorf("attach with both keys to a target that asks for none: %v (6.12 connects without authenticating)", err)
		} else if err := tg.Detach(ctx, nil); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	})
}
