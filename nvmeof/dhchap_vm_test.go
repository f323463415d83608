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
	ca, err := readCtrlAuth("/sys", "nvme"+itoa(inst))
	if err != nil {
		t.Fatal(err)
	}
	if err := deleteController("/sys", "nvme"+itoa(inst), func(*Controller) bool { return true }); err != nil {
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

// TestGuestDHCHAP attaches volumes with DH-HMAC-CHAP keys. On a kernel
// without in-band authentication (Debian 12's 6.1 kernels are built
// without CONFIG_NVME_AUTH and CONFIG_NVME_TARGET_AUTH) the kernel takes
// the keys and connects without authenticating when the target asks
// for none; berth must refuse such a volume and leave nothing
// connected. The authentication cases need both halves in the kernel.
func TestGuestDHCHAP(t *testing.T) {
	vm.RequireGuest(t)
	ctx := guestContext(t)
	tr := guestTransport(t, nil)
	host, err := tr.HostIdentity()
	if err != nil {
		t.Fatal(err)
	}
	// Keys as nvme-cli makes them, each hash.
	var keys []string
	for _, h := range []string{"1", "2", "3", "0"} {
		out, err := exec.Command("nvme", "gen-dhchap-key", "--hmac="+h, "--nqn", host.NQN).Output()
		if err != nil {
			t.Fatalf("nvme gen-dhchap-key: %v", err)
		}
		k := strings.TrimSpace(string(out))
		if _, err := ParseDHCHAPKey(SecretDHCHAPKey, k); err != nil {
			t.Fatalf("nvme-cli's key: %v", err)
		}
		keys = append(keys, k)
	}
	k1, k2, c1, c2 := keys[0], keys[1], keys[2], keys[3]
	hostAuth, targetAuth := kernelAuth(t, ctx, host.NQN, host.ID)
	t.Logf("kernel: host side in-band authentication %v, target side %v", hostAuth, targetAuth)

	if !hostAuth {
		t.Run("kernel without authentication", func(t *testing.T) {
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
			if err := plain.Detach(ctx); err != nil {
				t.Fatal(err)
			}
			wantControllers(t, nqn, 0)
		})
	}
	t.Run("authentication", func(t *testing.T) { guestDHCHAPAuth(t, ctx, tr, host.NQN, hostAuth, targetAuth, k1, k2, c1, c2) })
}

// guestDHCHAPAuth runs the cases that need in-band authentication in the
// kernel, both host and target side.
func guestDHCHAPAuth(t *testing.T, ctx context.Context, tr *Transport, hostNQN string, hostAuth, targetAuth bool, k1, k2, c1, c2 string) {
	if !hostAuth || !targetAuth {
		t.Skipf("SKIP: the guest kernel lacks NVMe in-band authentication (host side %v, target side %v: CONFIG_NVME_AUTH/CONFIG_NVME_HOST_AUTH, CONFIG_NVME_TARGET_AUTH); the DH-HMAC-CHAP cases need a guest kernel with both", hostAuth, targetAuth)
	}

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
		start := time.Now()
		dev, err := tg.Attach(ctx)
		if err == nil {
			tg.Detach(ctx)
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
		tg, err := tr.Parse(vc("1"), map[string]string{SecretDHCHAPKey: k1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		cs := wantControllers(t, nqn, 1)
		ca, err := readCtrlAuth("/sys", cs[0].Name)
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
		if err := tg2.Detach(ctx); err != nil {
			t.Fatal(err)
		}
		if err := tg.Detach(ctx); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	})
	t.Run("wrong host key", func(t *testing.T) {
		attachFails(t, "1", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrPermissionDenied)
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
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k1, CtrlKey: c1})
		tg, err := tr.Parse(vc("1"), map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		wantControllers(t, nqn, 1)
		if err := tg.Detach(ctx); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
	})
	t.Run("wrong controller key", func(t *testing.T) {
		// The target proves c1; the host expects c2 and must refuse it.
		attachFails(t, "1", map[string]string{SecretDHCHAPKey: k1, SecretDHCHAPCtrlKey: c2}, errdefs.ErrPermissionDenied)
		wantControllers(t, nqn, 0)
	})
	t.Run("key changed on the target while connected", func(t *testing.T) {
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k1})
		vcr := vc("1")
		vcr["reconnectDelay"] = "1"
		tg, err := tr.Parse(vcr, map[string]string{SecretDHCHAPKey: k1})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg)
		// The target takes another key and drops the connection: every
		// reconnect with the old key fails.
		tgt.SetDHCHAP(hostNQN, target.NVMeDHCHAP{Key: k2})
		tgt.RemovePort(port)
		tgt.AddPort(port)
		waitFor(t, 20*time.Second, "a reconnect", func() bool {
			cs := controllersOf(t, nqn)
			return len(cs) == 1 && cs[0].State != StateLive
		})
		time.Sleep(3 * time.Second) // a few reconnect attempts
		abnormal, msg := tg.Health(ctx)
		t.Logf("health: %v %s", abnormal, msg)
		if !abnormal || !strings.Contains(msg, "DH-HMAC-CHAP") {
			t.Errorf("Health = %v, %q: want the path abnormal, naming DH-HMAC-CHAP", abnormal, msg)
		}
		noKeyIn(t, "health", msg, k1, k2)
		// A re-stage with the target's new key is refused while the
		// controller holds the old one.
		attachFails(t, "1", map[string]string{SecretDHCHAPKey: k2}, errdefs.ErrFailedPrecondition)
		if err := tg.Detach(ctx); err != nil {
			t.Fatal(err)
		}
		wantControllers(t, nqn, 0)
		tg2, err := tr.Parse(vc("1"), map[string]string{SecretDHCHAPKey: k2})
		if err != nil {
			t.Fatal(err)
		}
		mustAttach(t, ctx, tg2)
		if err := tg2.Detach(ctx); err != nil {
			t.Fatal(err)
		}
	})
}
