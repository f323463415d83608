package sanity

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// csi-sanity inside a QEMU guest against the berth binary of the image,
// with a controller that makes a new network target for every volume:
// an nvmet subsystem, or a LIO target with one LUN.

func TestVMSanityNVMe(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t,
		vm.WithTestRun("^TestGuestSanityNVMe$"),
		vm.WithMemory(1536),
		vm.WithTimeout(8*time.Minute))
}

func TestVMSanityISCSI(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t,
		vm.WithTestRun("^TestGuestSanityISCSI$"),
		vm.WithIscsid(),
		vm.WithMemory(1536),
		vm.WithTimeout(8*time.Minute))
}

const guestBerth = "/usr/bin/berth"

func TestGuestSanityNVMe(t *testing.T) {
	vm.RequireGuest(t)
	target.LoadModules(t, "nvmet", "nvmet_tcp", "nvme_tcp", "nvme_fabrics")
	ctl := newTargetController(t, func(tb testing.TB, id string, size int64) (map[string]string, func(int64)) {
		tgt := target.NewNVMeTarget(tb, target.NVMeConfig{
			NQN:        "nqn.2014-08.io.berth:" + id,
			Namespaces: []target.NVMeNamespace{{Size: size}},
			Ports:      []string{nvmePort},
		})
		ns := tgt.Namespace(1)
		return map[string]string{
				"transport": "nvmeof",
				"nqn":       tgt.NQN(),
				"traddr":    "127.0.0.1",
				"trsvcid":   "4420",
				"nsid":      "1",
				"uuid":      ns.UUID,
			}, func(size int64) {
				tgt.Grow(1, size)
			}
	})
	sanityBerth(t, guestBerth, t.TempDir(), ctl, "--transports", "nvmeof")
}

// All subsystems share one nvmet port.
const nvmePort = "127.0.0.1:4420"

// TestVMSanityNVMeDHCHAP runs csi-sanity's node specs with NVMe/TCP
// volumes whose targets require DH-HMAC-CHAP, host and controller keys
// in the stage secrets, in a guest booting Debian 13's 6.12 kernel (the
// default guest's 6.1 has no in-band authentication).
func TestVMSanityNVMeDHCHAP(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t,
		vm.WithKernel("trixie"),
		vm.WithTestRun("^TestGuestSanityNVMeDHCHAP$"),
		vm.WithMemory(1536),
		vm.WithTimeout(10*time.Minute))
}

func TestGuestSanityNVMeDHCHAP(t *testing.T) {
	vm.RequireGuest(t)
	target.LoadModules(t, "nvmet", "nvmet_tcp", "nvme_tcp", "nvme_fabrics")
	host, err := nvmeof.LoadHostIdentity(nvmeof.DefaultHostDir)
	if err != nil {
		t.Fatal(err)
	}
	gen := func(hmac string) string {
		out, err := exec.Command("nvme", "gen-dhchap-key", "--hmac="+hmac, "--nqn", host.NQN).Output()
		if err != nil {
			t.Fatalf("nvme gen-dhchap-key: %v", err)
		}
		return strings.TrimSpace(string(out))
	}
	key, ctrlKey := gen("1"), gen("2")
	dir := t.TempDir()
	secrets := filepath.Join(dir, "secrets.yaml")
	yaml := fmt.Sprintf("NodeStageVolumeSecret:\n  %s: %q\n  %s: %q\n", nvmeof.SecretDHCHAPKey, key, nvmeof.SecretDHCHAPCtrlKey, ctrlKey)
	if err := os.WriteFile(secrets, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	sanitySecretsFile = secrets
	ctl := newTargetController(t, func(tb testing.TB, id string, size int64) (map[string]string, func(int64)) {
		tgt := target.NewNVMeTarget(tb, target.NVMeConfig{
			NQN:          "nqn.2014-08.io.berth:" + id,
			Namespaces:   []target.NVMeNamespace{{Size: size}},
			Ports:        []string{nvmePort},
			AllowedHosts: []string{host.NQN},
			DHCHAP:       &target.NVMeDHCHAP{Key: key, CtrlKey: ctrlKey},
		})
		ns := tgt.Namespace(1)
		return map[string]string{
				"transport": "nvmeof",
				"nqn":       tgt.NQN(),
				"traddr":    "127.0.0.1",
				"trsvcid":   "4420",
				"nsid":      "1",
				"uuid":      ns.UUID,
			}, func(size int64) {
				tgt.Grow(1, size)
			}
	})
	sanityBerth(t, guestBerth, dir, ctl, "--transports", "nvmeof")
	// berth disconnected every controller it connected.
	nqns, _ := filepath.Glob("/sys/class/nvme/*/subsysnqn")
	for _, f := range nqns {
		if b, err := os.ReadFile(f); err == nil && strings.HasPrefix(string(b), "nqn.2014-08.io.berth:") {
			t.Errorf("controller left after sanity: %s: %s", f, b)
		}
	}
}

// TestVMSanityNVMeTLS runs csi-sanity's node specs with NVMe/TCP volumes
// whose nvmet port requires TLS, the PSK in the stage secrets, in a
// guest booting Debian 13's 6.12 kernel with its tlshd. Target and node
// share the guest's .nvme keyring: the target's keys (nvme-cli's) and
// berth's copies below it hold the same PSKs, so the shared keyring
// changes nothing the test checks.
func TestVMSanityNVMeTLS(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t,
		vm.WithKernel("trixie"),
		vm.WithTestRun("^TestGuestSanityNVMeTLS$"),
		vm.WithMemory(1536),
		vm.WithTimeout(10*time.Minute))
}

func TestGuestSanityNVMeTLS(t *testing.T) {
	vm.RequireGuest(t)
	target.LoadModules(t, "nvmet", "nvmet_tcp", "nvme_tcp", "nvme_fabrics")
	target.StartTLSHD(t)
	host, err := nvmeof.LoadHostIdentity(nvmeof.DefaultHostDir)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("nvme-trixie", "gen-tls-key", "--hmac=1").Output()
	if err != nil {
		t.Fatalf("nvme gen-tls-key: %v", err)
	}
	key := strings.TrimSpace(string(out))
	dir := t.TempDir()
	secrets := filepath.Join(dir, "secrets.yaml")
	yaml := fmt.Sprintf("NodeStageVolumeSecret:\n  %s: %q\n", nvmeof.SecretTLSKey, key)
	if err := os.WriteFile(secrets, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	sanitySecretsFile = secrets
	// The PSK is in no log line of berth's, and in no file of its
	// state (which outlives the run: the records of staged volumes).
	payload := key[len("NVMeTLSkey-1:01:") : len(key)-1]
	sanityCheckLogs = func(t *testing.T, log string) {
		if strings.Contains(log, payload[:24]) {
			t.Error("berth's log holds the TLS PSK")
		}
		if !strings.Contains(log, "inserted the TLS PSK") {
			t.Error("berth's log never says it inserted a PSK: the check proves nothing")
		}
	}
	defer func() { sanityCheckLogs = nil }()
	defer filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && p != secrets {
			if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), payload[:24]) {
				t.Errorf("%s holds the TLS PSK", p)
			}
		}
		return nil
	})
	const tlsPort = "127.0.0.1:4430"
	var created atomic.Int32 // target keys nvme-cli inserted
	ctl := newTargetController(t, func(tb testing.TB, id string, size int64) (map[string]string, func(int64)) {
		tgt := target.NewNVMeTarget(tb, target.NVMeConfig{
			NQN:          "nqn.2014-08.io.berth:" + id,
			Namespaces:   []target.NVMeNamespace{{Size: size}},
			Ports:        []string{tlsPort},
			AllowedHosts: []string{host.NQN},
			TLS:          "required",
		})
		target.InsertTLSKey(tb, host.NQN, tgt.NQN(), key)
		created.Add(1)
		ns := tgt.Namespace(1)
		return map[string]string{
				"transport": "nvmeof",
				"nqn":       tgt.NQN(),
				"traddr":    "127.0.0.1",
				"trsvcid":   "4430",
				"nsid":      "1",
				"uuid":      ns.UUID,
				"tls":       "true",
			}, func(size int64) {
				tgt.Grow(1, size)
			}
	})
	sanityBerth(t, guestBerth, dir, ctl, "--transports", "nvmeof")
	// berth disconnected every controller it connected, and removed
	// the keys it inserted.
	nqns, _ := filepath.Glob("/sys/class/nvme/*/subsysnqn")
	for _, f := range nqns {
		if b, err := os.ReadFile(f); err == nil && strings.HasPrefix(string(b), "nqn.2014-08.io.berth:") {
			t.Errorf("controller left after sanity: %s: %s", f, b)
		}
	}
	keys, err := os.ReadFile("/proc/keys")
	if err != nil {
		t.Fatal(err)
	}
	inserted := 0
	for _, line := range strings.Split(string(keys), "\n") {
		if strings.Contains(line, " psk ") && strings.Contains(line, "nqn.2014-08.io.berth:") {
			inserted++
		}
	}
	// nvme-cli's keys of the target side stay, one per subsystem the
	// test made; berth's copies must be gone.
	t.Logf("%d PSKs of the test's subsystems left in the kernel's keys, %d of them the target's", inserted, created.Load())
	if created.Load() == 0 || inserted != int(created.Load()) {
		t.Errorf("%d PSKs of the test's subsystems left, want the target's %d: berth left keys behind", inserted, created.Load())
	}
}

func TestGuestSanityISCSI(t *testing.T) {
	vm.RequireGuest(t)
	ctl := newTargetController(t, func(tb testing.TB, id string, size int64) (map[string]string, func(int64)) {
		// A serial of 32 hex digits: LIO's NAA designator is 6001405
		// followed by its first 25.
		sum := sha256.Sum256([]byte(id))
		serial := hex.EncodeToString(sum[:16])
		tgt := target.NewISCSITarget(tb, target.ISCSIConfig{
			IQN:     "iqn.2003-01.io.berth:" + id,
			Portals: []string{iscsiPortal},
			LUNs:    []target.ISCSILUN{{Size: size, Serial: serial}},
		})
		return map[string]string{
				"targetPortal": iscsiPortal,
				"iqn":          tgt.IQN(),
				"lun":          "0",
				"wwid":         "naa.6001405" + serial[:25],
			}, func(size int64) {
				tgt.Grow(0, size)
			}
	})
	sanityBerth(t, guestBerth, t.TempDir(), ctl, "--transports", "iscsi")
}

// All targets share one portal.
const iscsiPortal = "127.0.0.1:3260"

// newVolumeFunc makes a target exporting a new volume of size bytes and
// returns its volume_context and a function that grows it. It reports
// failures on tb and registers the target's removal with tb.Cleanup.
type newVolumeFunc func(tb testing.TB, id string, size int64) (map[string]string, func(int64))

// targetController is a CSI Controller whose volumes are network targets
// made in the guest. DeleteVolume forgets a volume; its target is removed
// when the test ends.
type targetController struct {
	csi.UnimplementedControllerServer
	csi.UnimplementedIdentityServer
	t      *testing.T
	tb     *callTB // what the targets report on
	create newVolumeFunc

	mu   sync.Mutex
	vols map[string]*targetVolume
	n    int
}

type targetVolume struct {
	size int64
	vc   map[string]string
	grow func(int64)
}

func newTargetController(t *testing.T, create newVolumeFunc) *targetController {
	return &targetController{t: t, tb: &callTB{TB: t}, create: create, vols: make(map[string]*targetVolume)}
}

// callTB turns a fatal failure of the target package during an RPC into
// a panic that the RPC recovers as an Internal error: FailNow must not
// run on a gRPC goroutine. Outside RPCs, failures (those of the targets'
// cleanups at the end of the test) go to the test as usual.
type callTB struct {
	testing.TB
	inCall atomic.Bool
}

type callFailure struct{ msg string }

func (c *callTB) Fatal(args ...any) { c.fail(fmt.Sprint(args...)) }

func (c *callTB) Fatalf(format string, args ...any) { c.fail(fmt.Sprintf(format, args...)) }

func (c *callTB) FailNow() { c.fail("FailNow") }

func (c *callTB) fail(msg string) {
	if c.inCall.Load() {
		panic(callFailure{msg})
	}
	c.TB.Fatal(msg)
}

// run calls f with c.tb and returns f's fatal failure as an error. The
// caller holds c.mu.
func (c *targetController) run(f func(tb testing.TB)) (err error) {
	c.tb.inCall.Store(true)
	defer func() {
		c.tb.inCall.Store(false)
		if r := recover(); r != nil {
			cf, ok := r.(callFailure)
			if !ok {
				panic(r)
			}
			c.t.Logf("controller: %s", cf.msg)
			err = status.Error(codes.Internal, cf.msg)
		}
	}()
	f(c.tb)
	return nil
}

func (c *targetController) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: driverName, VendorVersion: "sanity"}, nil
}

func (c *targetController) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{controllerServiceCap()}}, nil
}

func (c *targetController) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (c *targetController) ControllerGetCapabilities(ctx context.Context, req *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return (&fileController{}).ControllerGetCapabilities(ctx, req)
}

func (c *targetController) CreateVolume(_ context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	id, size, err := checkCreate(req)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.vols[id]
	switch {
	case ok && v.size != size:
		return nil, status.Errorf(codes.AlreadyExists, "volume %s exists with %d bytes", req.GetName(), v.size)
	case !ok:
		// A deleted volume's target lives on: a name created again gets
		// a target of its own.
		c.n++
		v = &targetVolume{size: size}
		err := c.run(func(tb testing.TB) {
			v.vc, v.grow = c.create(tb, id+"-"+strconv.Itoa(c.n), size)
		})
		if err != nil {
			return nil, err
		}
		c.vols[id] = v
	}
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:      id,
		CapacityBytes: size,
		VolumeContext: v.vc,
	}}, nil
}

func (c *targetController) DeleteVolume(_ context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id: missing")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.vols, req.GetVolumeId())
	return &csi.DeleteVolumeResponse{}, nil
}

func (c *targetController) ControllerExpandVolume(_ context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id: missing")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.vols[req.GetVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s", req.GetVolumeId())
	}
	size := max(req.GetCapacityRange().GetRequiredBytes(), v.size)
	if size > v.size {
		if err := c.run(func(testing.TB) { v.grow(size) }); err != nil {
			return nil, err
		}
		v.size = size
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: true}, nil
}

func (c *targetController) ValidateVolumeCapabilities(_ context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	c.mu.Lock()
	_, ok := c.vols[req.GetVolumeId()]
	c.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s", req.GetVolumeId())
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeCapabilities: req.GetVolumeCapabilities(),
	}}, nil
}
