package devices

import (
	"context"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
)

// FlushDevice writes the device's dirty buffers and drops its buffer cache
// (fsync and BLKFLSBUF), so nothing is lost or read stale when it goes away.
// ctx bounds the wait; a flush stuck in the kernel (a path-less map that
// queues I/O) cannot be interrupted, only abandoned.
func FlushDevice(ctx context.Context, dev *Device) error {
	done := make(chan error, 1)
	go func() {
		f, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			done <- err
			return
		}
		defer f.Close()
		done <- blockdev.Flush(f)
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("flush %s: %w", dev.Path, err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("flush %s: %w", dev.Path, ctx.Err())
	}
}
