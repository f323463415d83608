package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/logctx"
)

// expandSettle bounds how long Expand, which does not know the size to
// expect, waits for a size change after asking for a rescan when no
// controller answers an Identify Namespace command.
const expandSettle = time.Second

// expandRescanWait bounds how long Expand waits for the kernel to take a
// size a controller already reports (a rescan takes milliseconds).
const expandRescanWait = 10 * time.Second

// Expand returns the namespace's size as its controller reports it now.
// It asks a live controller (Identify Namespace): when the kernel already
// has that size it returns at once; when the target grew, it asks the
// controllers to rescan and returns once the kernel shows the new size.
// A caller that knows the size it needs should use ExpandTo, which waits
// for exactly that.
func (tg *Target) Expand(ctx context.Context) (int64, error) {
	return tg.expand(ctx, 0)
}

// ExpandTo waits until the namespace reports at least minBytes. Targets
// announce a new size by an asynchronous event (AEN); the kernel then
// changes the device's size and sends a "change" uevent. ExpandTo
// subscribes to those events, checks sysfs once, asks live controllers
// to rescan (for targets that send no AEN), then waits until ctx ends.
func (tg *Target) ExpandTo(ctx context.Context, minBytes int64) (int64, error) {
	if minBytes <= 0 {
		return 0, fmt.Errorf("expand %s: required size %d: %w", tg.Key(), minBytes, errdefs.ErrInvalidArgument)
	}
	return tg.expand(ctx, minBytes)
}

func (tg *Target) expand(ctx context.Context, minBytes int64) (int64, error) {
	t := tg.t
	if t.opts.Listener == nil {
		return 0, fmt.Errorf("expand %s: the transport has no device listener: %w", tg.Key(), errdefs.ErrFailedPrecondition)
	}
	h, ok, err := tg.head()
	if err != nil {
		return 0, fmt.Errorf("expand %s: %w", tg.Key(), err)
	}
	if !ok {
		return 0, fmt.Errorf("expand %s: namespace not attached: %w", tg.Key(), errdefs.ErrNotFound)
	}
	var live []string
	if paths, err := t.sys.readNamespacePaths(h.Name); err == nil {
		ctrls, _ := t.sys.readControllers(tg.vol.NQN)
		for _, p := range paths {
			for _, c := range ctrls {
				if c.Name == p.Controller && c.State == StateLive {
					live = append(live, c.Name)
				}
			}
		}
	}
	// Without a size to wait for, the controller says which: the target's
	// size now, which the kernel has or takes with the rescan below.
	reported := false
	if minBytes <= 0 {
		if size, err := tg.reportedSize(live, h); err == nil {
			minBytes, reported = size, true
		} else {
			logctx.From(ctx, t.log).Debug("nvmeof: expand: no controller reported the namespace's size; waiting for a change instead", "target", tg.Key(), "error", err)
		}
	}
	sizeOf := func() (int64, error) { return t.sys.readSize(t.sys.root.Path("block", h.Name)) }
	// Subscribe first, then read: a change between the two is not lost.
	m := &sizeMatcher{name: h.Name, min: minBytes, not: -1}
	w := t.opts.Listener.Subscribe(m)
	defer w.Close()
	size, err := sizeOf()
	if err != nil {
		return 0, fmt.Errorf("expand %s: %w", tg.Key(), err)
	}
	if minBytes > 0 && size >= minBytes {
		return size, nil
	}
	m.setNot(size)
	for _, c := range live {
		if err := t.sys.rescanController(c); err != nil {
			logctx.From(ctx, t.log).Debug("nvmeof: rescan", "controller", c, "error", err)
		}
	}
	start := time.Now()
	if minBytes <= 0 {
		wctx, cancel := context.WithTimeout(ctx, expandSettle)
		defer cancel()
		if dev, err := w.Wait(wctx); err == nil {
			return dev.Size, nil
		} else if ctx.Err() != nil {
			return 0, fmt.Errorf("expand %s: %w", tg.Key(), err)
		}
		return sizeOf()
	}
	if reported {
		wctx, cancel := context.WithTimeout(ctx, expandRescanWait)
		defer cancel()
		dev, err := w.Wait(wctx)
		if err == nil {
			return dev.Size, nil
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("expand %s: %w", tg.Key(), err)
		}
		cur, err := sizeOf()
		if err != nil {
			return 0, fmt.Errorf("expand %s: %w", tg.Key(), err)
		}
		logctx.From(ctx, t.log).Warn("nvmeof: expand: the controller reports a size the kernel has not taken after a rescan", "target", tg.Key(),
			"device", h.Name, "reported_bytes", minBytes, "device_bytes", cur, "waited", time.Since(start).Round(time.Millisecond))
		return cur, nil
	}
	dev, err := w.Wait(ctx)
	if err != nil {
		if ctx.Err() != nil {
			cur, _ := sizeOf()
			return cur, fmt.Errorf("expand %s: namespace %s still reports %d bytes after %s, want %d; the target has not announced the new size: %w",
				tg.Key(), h.Name, cur, time.Since(start).Round(time.Millisecond), minBytes, errdefs.ErrUnavailable)
		}
		return 0, fmt.Errorf("expand %s: %w", tg.Key(), err)
	}
	return dev.Size, nil
}

// reportedSize asks the live controllers ctrls, one after another until
// one answers, for the size of the namespace h.
func (tg *Target) reportedSize(ctrls []string, h Head) (int64, error) {
	if len(ctrls) == 0 {
		return 0, fmt.Errorf("namespace %s: no live controller", h.Name)
	}
	var errs []error
	for _, c := range ctrls {
		size, err := devices.NVMeNamespaceSize(filepath.Join(tg.t.opts.DevRoot, c), h.NSID)
		if err == nil {
			return size, nil
		}
		errs = append(errs, err)
	}
	return 0, errors.Join(errs...)
}

// sizeMatcher matches a block device once it has at least min bytes
// (min > 0) or a size other than not (min == 0).
type sizeMatcher struct {
	name string
	min  int64
	mu   sync.Mutex
	not  int64 // -1: not known yet, matches nothing
}

func (m *sizeMatcher) setNot(n int64) {
	m.mu.Lock()
	m.not = n
	m.mu.Unlock()
}

func (m *sizeMatcher) Match(d *devices.Device) bool {
	if d == nil || d.Name != m.name {
		return false
	}
	if m.min > 0 {
		return d.Size >= m.min
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.not >= 0 && d.Size != m.not
}

func (m *sizeMatcher) String() string {
	if m.min > 0 {
		return fmt.Sprintf("%s with at least %d bytes", m.name, m.min)
	}
	return fmt.Sprintf("%s with a new size", m.name)
}
