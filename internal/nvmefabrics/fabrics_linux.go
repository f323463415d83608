// Package nvmefabrics is the kernel's NVMe over Fabrics connect
// interface, /dev/nvme-fabrics: the options it parses, and the connect
// written to it that creates a controller. A connect the kernel refuses
// gives a *ConnectError that says what its errno means (Reason).
package nvmefabrics

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Options reads the option list the kernel's connect interface
// prints before any connect ("instance=-1,cntlid=-1,transport=%s,...").
func Options(dev string) (string, error) {
	b, err := os.ReadFile(dev)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("open %s: the nvme-fabrics module is not loaded (modprobe nvme-tcp): %w", dev, errdefs.ErrUnavailable)
	}
	if err != nil {
		return "", fmt.Errorf("read the connect options of %s: %w", dev, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// connectResult is what one write to /dev/nvme-fabrics produced.
type connectResult struct {
	instance, cntlid int
	err              error
}

// Connect writes one connect string to dev and reads back the new
// controller's instance. The write blocks in the kernel for as long as
// the connect takes (up to its own connect timeout); when ctx ends first
// the call returns ctx's error and the kernel finishes on its own: a
// controller it creates then is found and reused by the next attach, or
// removed by the next detach.
func Connect(ctx context.Context, dev, opts string) (instance int, err error) {
	ch := make(chan connectResult, 1)
	go func() {
		i, c, err := connectSync(dev, opts)
		ch <- connectResult{i, c, err}
	}()
	select {
	case r := <-ch:
		return r.instance, r.err
	case <-ctx.Done():
		return 0, fmt.Errorf("connect: %w", ctx.Err())
	}
}

func connectSync(dev, opts string) (instance, cntlid int, err error) {
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return 0, 0, fmt.Errorf("open %s: the nvme-fabrics module is not loaded (modprobe nvme-tcp): %w", dev, errdefs.ErrUnavailable)
		}
		return 0, 0, fmt.Errorf("open %s: %w", dev, err)
	}
	defer f.Close()
	if _, err := f.Write([]byte(opts)); err != nil {
		return 0, 0, &ConnectError{Err: err}
	}
	buf := make([]byte, 128)
	n, err := f.Read(buf)
	if err != nil && n == 0 {
		return 0, 0, fmt.Errorf("read back from %s: %w", dev, err)
	}
	return parseReply(buf[:n])
}
