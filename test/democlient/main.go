// Command democlient takes one volume through the CSI node lifecycle
// against a running berth, as a CO would: stage, publish, write, expand,
// unpublish, unstage, stage again and check the data (package
// test/demo/steps). It prints every step with its result and duration and
// exits non-zero on the first unexpected answer. scripts/demo.sh runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/test/demo/steps"
)

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

	v := steps.Volume{ID: *volumeID, Context: vctx, FsType: *fsType, Work: *work, Restage: true}
	if *imagePath != "" {
		v.GrowStep, v.GrowTo = "grow the image file", *grow
		v.Grow = func(context.Context, int64) error { return os.Truncate(*imagePath, *grow) }
		v.Detached = func() (string, error) { return noLoopDevice(*imagePath) }
		v.Identify = func(dev string) (string, error) { return loopBacking(dev, *imagePath) }
	}
	r := steps.New(conn, func(line string) { fmt.Println(line) })
	if err := r.Lifecycle(v); err != nil {
		os.Exit(1)
	}
}

// noLoopDevice checks that no loop device is backed by the image.
func noLoopDevice(image string) (string, error) {
	want, err := filepath.EvalSymlinks(image)
	if err != nil {
		return "", err
	}
	paths, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return "", err
	}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if errors.Is(err, os.ErrNotExist) { // detached meanwhile
			continue
		}
		if err != nil {
			return "", err
		}
		if strings.TrimSpace(string(b)) == want {
			return "", fmt.Errorf("%s still backs %s", want, filepath.Base(filepath.Dir(filepath.Dir(p))))
		}
	}
	return "no loop device left", nil
}

// loopBacking checks that the loop device dev is backed by the image.
func loopBacking(dev, image string) (string, error) {
	want, err := filepath.EvalSymlinks(image)
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile(filepath.Join("/sys/class/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return "", err
	}
	if got := strings.TrimSpace(string(b)); got != want {
		return "", fmt.Errorf("%s is backed by %s, want %s", dev, got, want)
	}
	return "backed by " + filepath.Base(want), nil
}
