package nvmeof_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/nvmeof"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// startAgent serves berth's CSI node service with the nvmeof transport
// on a unix socket and returns a client of it.
func startAgent(t testing.TB, logger *slog.Logger) csi.NodeClient {
	l := csitest.Listener(t)
	// As berth serve wires it: the transport asks the agent which
	// volumes are staged.
	late := new(csitest.Late)
	tr, err := nvmeof.NewTransport(nvmeof.Options{Listener: l, Logger: logger, Staged: late.Staged})
	if err != nil {
		t.Fatal(err)
	}
	return csitest.StartAgentLate(t, logger, l, filepath.Join(t.TempDir(), "state"), late,
		agent.TransportFunc(agent.TransportKind{Name: nvmeof.Name, Keys: nvmeof.TransportKeys()}, tr.Parse))
}

func subsysControllers(t *testing.T, nqn string) int {
	t.Helper()
	ents, err := os.ReadDir("/sys/class/nvme")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
		if err == nil && strings.TrimSpace(string(b)) == nqn {
			n++
		}
	}
	return n
}

// TestGuestAgentLifecycle drives NVMe/TCP volumes through the agent's
// gRPC API: stage, publish, write, unpublish, unstage (disconnect),
// stage again and find the data, read-only publish, online expand.
func TestGuestAgentLifecycle(t *testing.T) {
	vm.RequireGuest(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	node := startAgent(t, logger)
	nqn := "nqn.2026-01.io.berth:lifecycle"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4440", "127.0.0.1:4441"},
		Namespaces: []target.NVMeNamespace{{Size: 64 << 20}, {Size: 320 << 20}, {Size: 32 << 20}}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	for _, tc := range []struct {
		name   string
		nsid   string
		cap    *csi.VolumeCapability
		expand int64
	}{
		{"ext4", "1", csitest.MountCap("ext4"), 96 << 20},
		{"xfs", "2", csitest.MountCap("xfs"), 0},
		{"block", "3", csitest.BlockCap(), 48 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			block := tc.cap.GetBlock() != nil
			staging := filepath.Join(dir, "staging")
			targetPath := filepath.Join(dir, "pod", "vol")
			os.MkdirAll(staging, 0o750)
			os.MkdirAll(filepath.Dir(targetPath), 0o750)
			id := "vol-" + tc.name
			vctx := map[string]string{"nqn": nqn, "nsid": tc.nsid, "targets": "127.0.0.1:4440,127.0.0.1:4441"}
			stage := func() {
				t.Helper()
				start := time.Now()
				if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: tc.cap, VolumeContext: vctx}); err != nil {
					t.Fatalf("NodeStageVolume: %v", err)
				}
				t.Logf("NodeStageVolume in %v", time.Since(start).Round(time.Millisecond))
				// Repeating it is a no-op.
				if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: tc.cap, VolumeContext: vctx}); err != nil {
					t.Fatalf("repeated NodeStageVolume: %v", err)
				}
			}
			publish := func(ro bool) {
				t.Helper()
				if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: targetPath, VolumeCapability: tc.cap, VolumeContext: vctx, Readonly: ro}); err != nil {
					t.Fatalf("NodePublishVolume: %v", err)
				}
			}
			unpublishUnstage := func() {
				t.Helper()
				for i := 0; i < 2; i++ {
					if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetPath}); err != nil {
						t.Fatalf("NodeUnpublishVolume: %v", err)
					}
				}
				for i := 0; i < 2; i++ {
					if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
						t.Fatalf("NodeUnstageVolume: %v", err)
					}
				}
				if n := subsysControllers(t, nqn); n != 0 {
					t.Fatalf("%d controllers left after unstage", n)
				}
			}
			dataPath := filepath.Join(targetPath, "data")
			if block {
				dataPath = targetPath
			}

			stage()
			if n := subsysControllers(t, nqn); n != 2 {
				t.Errorf("%d controllers after stage, want 2 (one per path)", n)
			}
			publish(false)
			payload := make([]byte, 1<<20)
			rand.Read(payload)
			sum := sha256.Sum256(payload)
			f, err := os.OpenFile(dataPath, os.O_WRONLY|os.O_CREATE, 0o644)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.Write(payload); err != nil {
				t.Fatal(err)
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			f.Close()

			st, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: targetPath})
			if err != nil {
				t.Fatalf("NodeGetVolumeStats: %v", err)
			}
			if c := st.GetVolumeCondition(); c == nil || c.GetAbnormal() {
				t.Errorf("volume condition %v", c)
			} else {
				t.Logf("condition: %s", c.GetMessage())
			}

			if tc.expand > 0 {
				n, _ := strconv.ParseUint(tc.nsid, 10, 32)
				tgt.Grow(uint32(n), tc.expand)
				resp, err := node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: targetPath, StagingTargetPath: staging,
					CapacityRange: &csi.CapacityRange{RequiredBytes: tc.expand}, VolumeCapability: tc.cap})
				if err != nil {
					t.Fatalf("NodeExpandVolume: %v", err)
				}
				if resp.GetCapacityBytes() != tc.expand {
					t.Errorf("expanded to %d, want %d", resp.GetCapacityBytes(), tc.expand)
				}
				if !block {
					var sfs unix.Statfs_t
					if err := unix.Statfs(targetPath, &sfs); err != nil {
						t.Fatal(err)
					}
					t.Logf("filesystem size after expand: %d bytes", int64(sfs.Blocks)*sfs.Bsize)
					if int64(sfs.Blocks)*sfs.Bsize < tc.expand*8/10 {
						t.Errorf("filesystem not grown: %d bytes", int64(sfs.Blocks)*sfs.Bsize)
					}
				}
			}
			unpublishUnstage()

			// Stage again: the same data, nothing reformatted.
			stage()
			publish(true)
			got := make([]byte, len(payload))
			f, err = os.Open(dataPath)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			f.Close()
			if sha256.Sum256(got) != sum {
				t.Fatal("data read after restage differs from what was written")
			}
			// A read-only publish refuses writes to the filesystem. (A
			// read-only bind mount of a device node does not stop
			// writes to the device; that is the agent's to enforce.)
			if block {
				unpublishUnstage()
				return
			}
			if f, err := os.OpenFile(dataPath, os.O_WRONLY, 0); err == nil {
				_, werr := f.Write(payload[:4096])
				f.Close()
				if werr == nil || !errors.Is(werr, syscall.EROFS) && !errors.Is(werr, syscall.EPERM) {
					t.Errorf("write through a read-only publish: %v", werr)
				}
			} else if !errors.Is(err, syscall.EROFS) && !errors.Is(err, syscall.EACCES) && !errors.Is(err, syscall.EPERM) {
				t.Errorf("open for write through a read-only publish: %v", err)
			}
			unpublishUnstage()
		})
	}
}
