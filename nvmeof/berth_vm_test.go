package nvmeof_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// berthProcess is `berth serve` running in the guest.
type berthProcess struct {
	t        *testing.T
	endpoint string
	stateDir string
	cmd      *exec.Cmd
	conn     *grpc.ClientConn
	node     csi.NodeClient
}

func startBerth(t *testing.T, dir string) *berthProcess {
	t.Helper()
	b := &berthProcess{t: t, endpoint: "unix://" + filepath.Join(dir, "csi.sock"), stateDir: filepath.Join(dir, "state")}
	b.cmd = exec.Command("/usr/bin/berth", "serve", "--endpoint", b.endpoint, "--state-dir", b.stateDir,
		"--node-id", "guest", "--transports", "nvmeof", "--log-format", "text")
	b.cmd.Stdout = csitest.LogWriter(t)
	b.cmd.Stderr = csitest.LogWriter(t)
	if err := b.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.stop)
	conn, err := grpc.NewClient(b.endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	b.conn, b.node = conn, csi.NewNodeClient(conn)
	ident := csi.NewIdentityClient(conn)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		r, err := ident.Probe(ctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && (r.GetReady() == nil || r.GetReady().GetValue()) {
			return b
		}
		if time.Now().After(deadline) {
			t.Fatalf("berth serve not ready: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop ends berth with SIGTERM, as systemd does.
func (b *berthProcess) stop() {
	if b.cmd == nil {
		return
	}
	b.conn.Close()
	b.cmd.Process.Signal(syscall.SIGTERM)
	b.cmd.Wait()
	b.cmd = nil
}

// TestGuestBerthSharedSubsystem runs the berth binary with its NVMe-oF
// transport: two volumes of one subsystem over two paths share two
// controllers; the agent restarts in between; unstaging the first keeps
// the controllers the second uses, unstaging the second removes them.
func TestGuestBerthSharedSubsystem(t *testing.T) {
	vm.RequireGuest(t)
	dir := t.TempDir()
	nqn := "nqn.2026-01.io.berth:shared"
	target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4445", "127.0.0.1:4446"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}, {Size: 64 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	b := startBerth(t, dir)
	type vol struct{ id, staging, file string }
	vols := []vol{{id: "shared-1"}, {id: "shared-2"}}
	vctx := func(nsid string) map[string]string {
		return map[string]string{"transport": "nvmeof", "nqn": nqn, "nsid": nsid, "targets": "127.0.0.1:4445,127.0.0.1:4446"}
	}
	for i := range vols {
		v := &vols[i]
		v.staging = filepath.Join(dir, v.id)
		os.MkdirAll(v.staging, 0o750)
		if _, err := b.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
			VolumeCapability: csitest.MountCap("ext4"), VolumeContext: vctx([]string{"1", "2"}[i])}); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", v.id, err)
		}
		v.file = filepath.Join(v.staging, "data")
		if err := os.WriteFile(v.file, []byte(v.id), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if n := subsysControllers(t, nqn); n != 2 {
		t.Fatalf("%d controllers for two volumes over two paths, want 2", n)
	}

	// A restart: the new process knows the volumes from its state only.
	b.stop()
	b = startBerth(t, dir)

	if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vols[0].id, StagingTargetPath: vols[0].staging}); err != nil {
		t.Fatalf("NodeUnstageVolume %s: %v", vols[0].id, err)
	}
	if n := subsysControllers(t, nqn); n != 2 {
		t.Fatalf("%d controllers after unstaging one of two volumes, want 2", n)
	}
	st, err := b.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vols[1].id, VolumePath: vols[1].staging})
	if err != nil {
		t.Fatalf("NodeGetVolumeStats: %v", err)
	}
	if c := st.GetVolumeCondition(); c == nil || c.GetAbnormal() {
		t.Errorf("second volume's condition after the first was unstaged: %v", c)
	} else {
		t.Logf("condition: %s", c.GetMessage())
	}
	if got, err := os.ReadFile(vols[1].file); err != nil || string(got) != vols[1].id {
		t.Errorf("second volume's data: %q, %v", got, err)
	}
	for i := 0; i < 2; i++ {
		if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vols[1].id, StagingTargetPath: vols[1].staging}); err != nil {
			t.Fatalf("NodeUnstageVolume %s: %v", vols[1].id, err)
		}
	}
	if n := subsysControllers(t, nqn); n != 0 {
		t.Fatalf("%d controllers after unstaging both volumes, want 0", n)
	}
}
