// Package steps takes one volume through the CSI node lifecycle against a
// running berth, as a container orchestrator would: stage, publish, write,
// expand, unpublish, unstage, and optionally stage again to read the data
// back. Each call prints one line with its result and its duration; every
// result is checked (mounts in the mount table, sizes, data, detach), so a
// broken berth fails the run. The demo client (test/democlient) and the
// in-guest demo tests (test/demo) share it, so the demo prints one format
// for every transport.
package steps

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Volume is one volume for Lifecycle.
type Volume struct {
	ID      string
	Context map[string]string // volume_context
	Secrets map[string]string // stage secrets (never printed)
	FsType  string            // ext4 or xfs
	// Work is a directory for the staging and target paths.
	Work string

	// Grow enlarges the storage behind the volume to GrowTo bytes before
	// NodeExpandVolume; GrowStep names that step. Without Grow the
	// expand steps are left out.
	Grow     func(ctx context.Context, size int64) error
	GrowStep string
	GrowTo   int64

	// Detached checks that nothing of the volume is left on the node
	// after NodeUnstageVolume (no session, no controller, no loop
	// device) and describes what it checked. Optional.
	Detached func() (string, error)

	// Identify checks that the staged device is the volume's (read from
	// sysfs, independently of berth) and describes it briefly. Optional.
	Identify func(device string) (string, error)

	// RefusedSecrets, when set, are stage secrets berth must refuse with
	// RefusedCode and a message containing RefusedWhy (e.g. a wrong CHAP
	// password) before the volume is staged with Secrets; RefusedStep
	// names that step.
	RefusedSecrets map[string]string
	RefusedCode    codes.Code
	RefusedWhy     string
	RefusedStep    string

	// Restage stages and publishes the volume once more after unstaging
	// it and reads the data back from the storage.
	Restage bool
}

// Runner runs steps and prints one line per step through Print.
type Runner struct {
	node     csi.NodeClient
	identity csi.IdentityClient
	// Print receives each output line, without a newline.
	Print func(line string)
	// Timeout bounds each step (default 2 minutes).
	Timeout time.Duration
	err     error
}

// New returns a Runner on a connection to berth's CSI socket.
func New(conn grpc.ClientConnInterface, print func(string)) *Runner {
	return &Runner{node: csi.NewNodeClient(conn), identity: csi.NewIdentityClient(conn), Print: print, Timeout: 2 * time.Minute}
}

// Err is the first step failure, nil when every step so far succeeded.
func (r *Runner) Err() error { return r.err }

// Step runs f unless an earlier step failed, and prints its name, its
// outcome, its duration and the detail f returns (or the error).
func (r *Runner) Step(name string, f func(ctx context.Context) (string, error)) {
	if r.err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.Timeout)
	defer cancel()
	start := time.Now()
	detail, err := f(ctx)
	elapsed := time.Since(start).Round(10 * time.Microsecond)
	if err != nil {
		r.err = fmt.Errorf("%s: %s", name, describe(err))
		r.Print(fmt.Sprintf("  %-30s FAILED  %10v  %s", name, elapsed, describe(err)))
		return
	}
	r.Print(fmt.Sprintf("  %-30s ok      %10v  %s", name, elapsed, detail))
}

func describe(err error) string {
	if s, ok := status.FromError(err); ok {
		return s.Code().String() + ": " + s.Message()
	}
	return err.Error()
}

// Probe waits until berth answers Probe with ready.
func (r *Runner) Probe() {
	r.Step("Probe", func(ctx context.Context) (string, error) {
		for {
			p, err := r.identity.Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
			if err != nil {
				return "", err
			}
			if p.GetReady() == nil || p.GetReady().GetValue() {
				return "ready", nil
			}
			select {
			case <-ctx.Done():
				return "", fmt.Errorf("not ready: %w", ctx.Err())
			case <-time.After(50 * time.Millisecond):
			}
		}
	})
}

// Lifecycle waits until berth is ready, takes v through the node lifecycle
// and returns the first failure.
func (r *Runner) Lifecycle(v Volume) error {
	staging := filepath.Join(v.Work, "staging")
	podDir := filepath.Join(v.Work, "pod")
	target := filepath.Join(podDir, "volume")
	for _, dir := range []string{staging, podDir} { // the CO creates these
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	vcap := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: v.FsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	// A megabyte of random data with a known digest: it must come back
	// unchanged after the expand and after a detach and reattach.
	payload := make([]byte, 1<<20)
	rand.Read(payload)
	digest := sha256.Sum256(payload)
	dataFile := filepath.Join(target, "demo.bin")
	var device string // the staged filesystem's source, from the mount table

	stage := func(ctx context.Context) (string, error) {
		_, err := r.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.ID, StagingTargetPath: staging,
			VolumeCapability: vcap, VolumeContext: v.Context, Secrets: v.Secrets})
		if err != nil {
			return "", err
		}
		m, err := mountAt(staging)
		if err != nil {
			return "", err
		}
		if m.FSType != v.FsType {
			return "", fmt.Errorf("%s mounted at %s, want %s", m.FSType, staging, v.FsType)
		}
		if device != "" && m.Source != device {
			r.Print(fmt.Sprintf("  (the volume came back as %s, was %s)", m.Source, device))
		}
		device = m.Source
		size, err := blockSize(device)
		if err != nil {
			return "", err
		}
		id := ""
		if v.Identify != nil {
			if id, err = v.Identify(device); err != nil {
				return "", err
			}
			id = ", " + id
		}
		return fmt.Sprintf("%s (%d MiB%s) %s at %s", device, size>>20, id, m.FSType, staging), nil
	}
	publish := func(ctx context.Context) (string, error) {
		_, err := r.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.ID, StagingTargetPath: staging,
			TargetPath: target, VolumeCapability: vcap, VolumeContext: v.Context})
		if err != nil {
			return "", err
		}
		m, err := mountAt(target)
		if err != nil {
			return "", err
		}
		if m.Source != device || m.FSType != v.FsType {
			return "", fmt.Errorf("%s is %s on %s, want %s on %s", target, m.FSType, m.Source, v.FsType, device)
		}
		return "bind mount at " + target, nil
	}
	unpublish := func(ctx context.Context) (string, error) {
		_, err := r.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.ID, TargetPath: target})
		if err != nil {
			return "", err
		}
		if err := notMounted(target); err != nil {
			return "", err
		}
		return "target unmounted", nil
	}
	unstage := func(ctx context.Context) (string, error) {
		_, err := r.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.ID, StagingTargetPath: staging})
		if err != nil {
			return "", err
		}
		if err := notMounted(staging); err != nil {
			return "", err
		}
		detail := "unmounted"
		if v.Detached != nil {
			d, err := v.Detached()
			if err != nil {
				return "", err
			}
			detail += ", " + d
		}
		return detail, nil
	}
	readBack := func(context.Context) (string, error) {
		got, err := os.ReadFile(dataFile)
		if err != nil {
			return "", err
		}
		if sha256.Sum256(got) != digest {
			return "", fmt.Errorf("%s: %d bytes read back differ from the %d written", dataFile, len(got), len(payload))
		}
		return fmt.Sprintf("%d bytes, sha256 %x… matches", len(got), digest[:6]), nil
	}
	var total int64 // filesystem size after the last stats step
	stats := func(ctx context.Context) (string, error) {
		s, err := r.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.ID, VolumePath: target})
		if err != nil {
			return "", err
		}
		var bytesUsage *csi.VolumeUsage
		for _, u := range s.GetUsage() {
			if u.GetUnit() == csi.VolumeUsage_BYTES {
				bytesUsage = u
			}
		}
		if bytesUsage == nil || bytesUsage.GetTotal() <= 0 {
			return "", fmt.Errorf("no byte usage in %v", s.GetUsage())
		}
		if c := s.GetVolumeCondition(); c != nil && c.GetAbnormal() {
			return "", fmt.Errorf("volume condition abnormal: %s", c.GetMessage())
		}
		total = bytesUsage.GetTotal()
		return fmt.Sprintf("filesystem %d MiB, %d MiB used, healthy", total>>20, bytesUsage.GetUsed()>>20), nil
	}

	r.Print(fmt.Sprintf("volume %s (%s), volume_context %v", v.ID, v.FsType, v.Context))
	r.Probe()
	if v.RefusedSecrets != nil {
		r.Step(v.RefusedStep, func(ctx context.Context) (string, error) {
			_, err := r.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.ID, StagingTargetPath: staging,
				VolumeCapability: vcap, VolumeContext: v.Context, Secrets: v.RefusedSecrets})
			if c := status.Code(err); c != v.RefusedCode {
				if err == nil {
					return "", fmt.Errorf("staged, want %v", v.RefusedCode)
				}
				return "", fmt.Errorf("want %v, got %w", v.RefusedCode, err)
			}
			if !strings.Contains(err.Error(), v.RefusedWhy) {
				return "", fmt.Errorf("want a message saying %q, got %w", v.RefusedWhy, err)
			}
			for _, secret := range v.RefusedSecrets {
				if strings.Contains(err.Error(), secret) {
					return "", errors.New("the error holds a secret")
				}
			}
			if err := notMounted(staging); err != nil {
				return "", err
			}
			return fmt.Sprintf("refused: %v (%s)", status.Code(err), v.RefusedWhy), nil
		})
	}
	r.Step("NodeStageVolume", stage)
	r.Step("NodeStageVolume (repeated)", stage)
	r.Step("NodePublishVolume", publish)
	r.Step("write 1 MiB in the volume", func(context.Context) (string, error) {
		if err := writeSync(dataFile, payload); err != nil {
			return "", err
		}
		return fmt.Sprintf("%s in the target path, sha256 %x…", filepath.Base(dataFile), digest[:6]), nil
	})
	r.Step("NodeGetVolumeStats", stats)
	if v.Grow != nil {
		before := total
		r.Step(v.GrowStep, func(ctx context.Context) (string, error) {
			return fmt.Sprintf("to %d MiB", v.GrowTo>>20), v.Grow(ctx, v.GrowTo)
		})
		r.Step("NodeExpandVolume", func(ctx context.Context) (string, error) {
			e, err := r.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.ID, VolumePath: target,
				CapacityRange: &csi.CapacityRange{RequiredBytes: v.GrowTo}, VolumeCapability: vcap, StagingTargetPath: staging})
			if err != nil {
				return "", err
			}
			if e.GetCapacityBytes() < v.GrowTo {
				return "", fmt.Errorf("capacity %d bytes, want at least %d", e.GetCapacityBytes(), v.GrowTo)
			}
			size, err := blockSize(device)
			if err != nil {
				return "", err
			}
			if size < v.GrowTo {
				return "", fmt.Errorf("%s is %d bytes after the expand, want at least %d", device, size, v.GrowTo)
			}
			return fmt.Sprintf("capacity %d MiB, %s %d MiB", e.GetCapacityBytes()>>20, device, size>>20), nil
		})
		r.Step("NodeGetVolumeStats", func(ctx context.Context) (string, error) {
			d, err := stats(ctx)
			if err == nil && total < before+(v.GrowTo-before)/2 {
				err = fmt.Errorf("filesystem %d MiB after the expand, was %d MiB: it did not grow", total>>20, before>>20)
			}
			return d, err
		})
		r.Step("read the data back", readBack)
	}
	r.Step("NodeUnpublishVolume", unpublish)
	r.Step("NodeUnstageVolume", unstage)
	r.Step("NodeUnstageVolume (repeated)", unstage)
	if v.Restage {
		r.Step("NodeStageVolume again", stage)
		r.Step("NodePublishVolume again", publish)
		r.Step("read the data back", readBack)
		if v.Grow != nil {
			r.Step("filesystem size kept", func(context.Context) (string, error) {
				var st unix.Statfs_t
				if err := unix.Statfs(target, &st); err != nil {
					return "", fmt.Errorf("statfs %s: %w", target, err)
				}
				size := int64(st.Blocks) * st.Bsize
				if size < total-total/100 {
					return "", fmt.Errorf("filesystem %d MiB, was %d MiB before the unstage", size>>20, total>>20)
				}
				return fmt.Sprintf("%d MiB", size>>20), nil
			})
		}
		r.Step("NodeUnpublishVolume", unpublish)
		r.Step("NodeUnstageVolume", unstage)
	}
	return r.err
}

// mountAt returns the mount table entry of path, an error when nothing is
// mounted there.
func mountAt(path string) (*mountinfo.Info, error) {
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		return nil, err
	}
	if len(ms) == 0 {
		return nil, fmt.Errorf("nothing mounted at %s", path)
	}
	return ms[len(ms)-1], nil
}

func notMounted(path string) error {
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		return err
	}
	if len(ms) > 0 {
		return fmt.Errorf("%s on %s still mounted at %s", ms[0].FSType, ms[0].Source, path)
	}
	return nil
}

// blockSize is the size of the block device at path.
func blockSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n, err := unix.IoctlGetUint64(int(f.Fd()), unix.BLKGETSIZE64)
	if err != nil {
		return 0, fmt.Errorf("BLKGETSIZE64 %s: %w", path, err)
	}
	return int64(n), nil
}

func writeSync(path string, b []byte) (retErr error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer func() {
		if err := f.Close(); retErr == nil {
			retErr = err
		}
	}()
	if _, err := f.Write(b); err != nil {
		return err
	}
	return f.Sync()
}
