package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/test/reliability"
)

// fsIOCShutdown is XFS_IOC_GOINGDOWN, which ext4 answers too
// (EXT4_IOC_SHUTDOWN): _IOR('X', 125, __u32). goingDownNoLogFlush stops
// the filesystem without writing its log, as a lost device would.
const (
	fsIOCShutdown       = 0x8004587d
	goingDownNoLogFlush = 2
)

// shutDown stops the filesystem mounted at p as I/O errors would: xfs
// then answers every getattr with EIO.
func shutDown(t *testing.T, p string) {
	t.Helper()
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	must(t, "open "+p, err)
	defer unix.Close(fd)
	must(t, "shut down the filesystem", unix.IoctlSetPointerInt(fd, fsIOCShutdown, goingDownNoLogFlush))
}

// triggerExt4Error makes ext4 handle an error as its errors= option
// says (errors=remount-ro: the filesystem goes read-only).
func triggerExt4Error(t *testing.T, dev string) {
	t.Helper()
	p := filepath.Join("/sys/fs/ext4", filepath.Base(dev), "trigger_fs_error")
	must(t, "trigger an ext4 error", os.WriteFile(p, []byte("berth test\n"), 0o200))
}

// A filesystem that stopped after I/O errors (xfs shut down, ext4 shut
// down or remounted read-only by errors=remount-ro) is reported abnormal
// and can still be unpublished and unstaged: nothing of it is left on
// the node. Each case reports a row of make reliability's fault table.
func TestUnstageShutDownFilesystem(t *testing.T) {
	for _, tc := range []struct {
		name, fsType string
		size         int64
		flags        []string
		unpublished  bool // shut down while staged only
		fail         func(t *testing.T, h *harness, v vol)
		// getattr fails: the stats say the volume is abnormal.
		abnormal bool
	}{
		{"xfs shut down", "xfs", 300 * mib, nil, false, func(t *testing.T, _ *harness, v vol) { shutDown(t, v.staging) }, true},
		{"xfs shut down, not published", "xfs", 300 * mib, nil, true, func(t *testing.T, _ *harness, v vol) { shutDown(t, v.staging) }, true},
		{"ext4 shut down", "ext4", 64 * mib, nil, false, func(t *testing.T, _ *harness, v vol) { shutDown(t, v.staging) }, false},
		{"ext4 errors=remount-ro", "ext4", 64 * mib, []string{"errors=remount-ro"}, false, func(t *testing.T, h *harness, v vol) {
			triggerExt4Error(t, loopOf(t, h, "down.img"))
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			then := ": unpublished and unstaged"
			if tc.unpublished {
				then = ": unstaged"
			}
			fault := reliability.StartFault(t, tc.name+then)
			h.node = fault.Node(h.node)
			v := h.newVol("down", tc.size, mountCap(tc.fsType, snw, tc.flags...))
			must(t, "stage", h.stage(v))
			paths := []string{v.staging}
			if !tc.unpublished {
				must(t, "publish", h.publish(v, false))
				must(t, "write", os.WriteFile(filepath.Join(v.target, "f"), []byte("x"), 0o644))
				paths = append(paths, v.target)
			}
			tc.fail(t, h, v)

			for _, p := range paths {
				st, err := h.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: p})
				if err != nil {
					t.Errorf("stats of %s: %v", p, err)
					continue
				}
				if tc.abnormal && !st.GetVolumeCondition().GetAbnormal() {
					t.Errorf("stats of %s: %v; want an abnormal condition", p, st)
				}
				t.Logf("stats of %s: %v", p, st.GetVolumeCondition())
			}

			if tc.abnormal {
				// Nothing gives the dead filesystem to a pod again.
				ctx := context.Background()
				_, err := h.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx})
				wantCode(t, "stage again", err, codes.FailedPrecondition)
				other := filepath.Join(h.mkdir("pods/other"), "mount")
				_, err = h.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: other, VolumeCapability: v.cap, VolumeContext: v.vctx})
				wantCode(t, "publish elsewhere", err, codes.FailedPrecondition)
				if _, err := os.Lstat(other); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("refused publish left %s: %v", other, err)
				}
				_, err = h.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.staging})
				wantCode(t, "expand", err, codes.FailedPrecondition)
			}

			if !tc.unpublished {
				must(t, "unpublish", h.unpublish(v))
				if _, err := os.Lstat(v.target); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("target path still exists after unpublish: %v", err)
				}
			}
			must(t, "unstage", h.unstage(v))
			left := mountsAt(t, v.staging)
			if left != 0 {
				t.Errorf("%d mounts left at the staging path", left)
			}
			if d, err := (devices.Roots{}).FindLoop(filepath.Join(h.root, "down.img")); err == nil {
				t.Errorf("image still attached to %s after unstage", d.Path)
				left++
			}
			if n := len(stateFiles(t, h)); n != 0 {
				t.Errorf("%d state files after unstage", n)
				left += n
			}
			fault.Leaked(left)
		})
	}
}
