package devices

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
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

// FlushPath is the flush of FlushDevice for a caller that has only the
// device's path and bounds the wait itself. A device that is gone (no
// node, or a node whose disk went: ENXIO, ENODEV) has nothing to flush. A
// flush the device refuses with a reservation conflict (EBADE: NVMe Flush
// is a write command, which a reservation that fences this host forbids)
// returns an error wrapping ErrReservationConflict.
func FlushPath(path string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENXIO) || errors.Is(err, unix.ENODEV) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("flush %s: %w", path, err)
	}
	defer f.Close()
	if err := blockdev.Flush(f); err != nil {
		if errors.Is(err, unix.EBADE) {
			return fmt.Errorf("flush %s: %w: %w", path, err, ErrReservationConflict)
		}
		return fmt.Errorf("flush %s: %w", path, err)
	}
	return nil
}
