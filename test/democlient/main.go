// Command democlient takes one volume through the CSI node lifecycle
// against a running berth, as a CO would: stage, publish, write, expand,
// unpublish, unstage, stage again and check the data. It prints every
// step with its result and duration and exits non-zero on the first
// unexpected answer. scripts/demo.sh runs it.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

type demo struct {
	node     csi.NodeClient
	identity csi.IdentityClient
	failed   bool
}

// step runs one call and prints its outcome and duration.
func (d *demo) step(name string, f func(ctx context.Context) (string, error)) {
	if d.failed {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	detail, err := f(ctx)
	elapsed := time.Since(start).Round(10 * time.Microsecond)
	if err != nil {
		d.failed = true
		fmt.Printf("  %-28s FAILED  %10v  %v\n", name, elapsed, describe(err))
		return
	}
	fmt.Printf("  %-28s ok      %10v  %s\n", name, elapsed, detail)
}

func describe(err error) string {
	if s, ok := status.FromError(err); ok {
		return s.Code().String() + ": " + s.Message()
	}
	return err.Error()
}

func main() {
	endpoint := flag.String("endpoint", "", "berth's CSI endpoint (unix:///path)")
	image := flag.String("image", "", "image file in berth's --file-root (volume_context file)")
	imagePath := flag.String("image-path", "", "host path of the image, grown before the expand step")
	work := flag.String("work", "", "directory for the staging and target paths")
	fsType := flag.String("fs-type", "xfs", "filesystem: ext4 or xfs")
	grow := flag.Int64("grow-to", 600<<20, "image size in bytes after the expand step")
	volumeID := flag.String("volume-id", "demo-volume", "volume ID")
	extra := flag.String("context", "", "more volume_context entries, key=value,key=value (other transports)")
	flag.Parse()
	vctx := map[string]string{}
	if *image != "" {
		vctx["file"] = *image
	}
	if *extra != "" {
		for _, kv := range strings.Split(*extra, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				fmt.Fprintf(os.Stderr, "democlient: -context %q: want key=value\n", kv)
				os.Exit(2)
			}
			vctx[k] = v
		}
	}
	if *endpoint == "" || *work == "" || len(vctx) == 0 {
		fmt.Fprintln(os.Stderr, "democlient: -endpoint, -work and -image or -context are required")
		os.Exit(2)
	}
	conn, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "democlient:", err)
		os.Exit(1)
	}
	defer conn.Close()
	d := &demo{node: csi.NewNodeClient(conn), identity: csi.NewIdentityClient(conn)}

	staging := filepath.Join(*work, "staging")
	podDir := filepath.Join(*work, "pod")
	target := filepath.Join(podDir, "volume")
	for _, dir := range []string{staging, podDir} { // the CO creates these
		if err := os.MkdirAll(dir, 0o750); err != nil {
			fmt.Fprintln(os.Stderr, "democlient:", err)
			os.Exit(1)
		}
	}
	vcap := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: *fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	payload := []byte(fmt.Sprintf("written by the berth demo at %s\n", time.Now().UTC().Format(time.RFC3339)))

	stage := func(ctx context.Context) (string, error) {
		_, err := d.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: *volumeID, StagingTargetPath: staging, VolumeCapability: vcap, VolumeContext: vctx})
		return "mounted at " + staging, err
	}
	publish := func(ctx context.Context) (string, error) {
		_, err := d.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: *volumeID, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vcap, VolumeContext: vctx})
		return "bind-mounted at " + target, err
	}
	unpublish := func(ctx context.Context) (string, error) {
		_, err := d.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: *volumeID, TargetPath: target})
		return "target removed", err
	}
	unstage := func(ctx context.Context) (string, error) {
		_, err := d.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: *volumeID, StagingTargetPath: staging})
		return "unmounted and detached", err
	}
	stats := func(ctx context.Context) (string, error) {
		r, err := d.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: *volumeID, VolumePath: target})
		if err != nil {
			return "", err
		}
		u := r.GetUsage()[0]
		return fmt.Sprintf("%d MiB total, %d MiB used, abnormal=%t", u.Total>>20, u.Used>>20, r.GetVolumeCondition().GetAbnormal()), nil
	}

	fmt.Printf("volume %s (%s, volume_context %v)\n", *volumeID, *fsType, vctx)
	d.step("Probe", func(ctx context.Context) (string, error) {
		for {
			r, err := d.identity.Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
			if err == nil && r.GetReady().GetValue() {
				return "ready", nil
			}
			if err != nil {
				return "", err
			}
			select {
			case <-ctx.Done():
				return "", ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
	})
	d.step("NodeStageVolume", stage)
	d.step("NodeStageVolume (repeated)", stage)
	d.step("NodePublishVolume", publish)
	d.step("write a file in the volume", func(context.Context) (string, error) {
		return fmt.Sprintf("%d bytes", len(payload)), os.WriteFile(filepath.Join(target, "demo.txt"), payload, 0o644)
	})
	d.step("NodeGetVolumeStats", stats)
	if *imagePath != "" {
		d.step("grow the image file", func(context.Context) (string, error) {
			return fmt.Sprintf("%d MiB", *grow>>20), os.Truncate(*imagePath, *grow)
		})
	}
	d.step("NodeExpandVolume", func(ctx context.Context) (string, error) {
		r, err := d.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: *volumeID, VolumePath: target, CapacityRange: &csi.CapacityRange{RequiredBytes: *grow}, VolumeCapability: vcap})
		return fmt.Sprintf("capacity %d MiB", r.GetCapacityBytes()>>20), err
	})
	d.step("NodeGetVolumeStats", stats)
	d.step("NodeUnpublishVolume", unpublish)
	d.step("NodeUnstageVolume", unstage)
	d.step("NodeUnstageVolume (repeated)", unstage)
	d.step("NodeStageVolume again", stage)
	d.step("NodePublishVolume again", publish)
	d.step("read the file back", func(context.Context) (string, error) {
		got, err := os.ReadFile(filepath.Join(target, "demo.txt"))
		if err != nil {
			return "", err
		}
		if !bytes.Equal(got, payload) {
			return "", errors.New("the data changed across unstage and stage")
		}
		return "data intact", nil
	})
	d.step("NodeUnpublishVolume", unpublish)
	d.step("NodeUnstageVolume", unstage)
	if d.failed {
		os.Exit(1)
	}
}
