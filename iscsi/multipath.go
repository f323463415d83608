package iscsi

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/logctx"
)

// mapWait bounds the wait for multipathd to build (or grow) a map over the
// paths: a map that does not come is a multipath.conf matter (blacklist,
// find_multipaths), not something more waiting fixes.
const mapWait = 60 * time.Second

// waitMap waits for multipathd to build the map of wwid over every
// attached path.
func (t *Transport) waitMap(ctx context.Context, wwid string, pds []*pathDevice) (*devices.Device, error) {
	names := make([]string, len(pds))
	for i, pd := range pds {
		names[i] = pd.dev.Name
	}
	w := t.opts.Listener.Subscribe(devices.MatchMultipath(wwid, names...))
	defer w.Close()
	wctx, cancel := context.WithTimeout(ctx, mapWait)
	defer cancel()
	dm, err := w.Wait(wctx)
	if err != nil {
		if ctx.Err() == nil {
			return nil, errdefs.Unavailable("multipathd built no map over %s (WWID %s) within %s: check that multipath.conf neither blacklists these disks nor holds them back (find_multipaths); `multipath -v3` says why: %v",
				strings.Join(names, ", "), wwid, mapWait, err)
		}
		return nil, err
	}
	return dm, nil
}

// mapOf returns the multipath map holding the LUN's paths, or nil.
func (t *Transport) mapOf(pds []*pathDevice) *devices.Device {
	for _, pd := range pds {
		if pd.dev == nil {
			continue
		}
		if dm, err := t.devs.MultipathMap(pd.dev.Name); err == nil {
			return dm
		}
	}
	return nil
}

// mapName is the name multipathd knows a map by.
func mapName(dm *devices.Device) string {
	if dm.ID.DMName != "" {
		return dm.ID.DMName
	}
	return dm.Name
}

// failQueueing makes the map fail I/O while no path works: at once,
// through device-mapper, and through multipathd (when it runs), so that
// it does not turn queueing back on when it next loads the map.
func (t *Transport) failQueueing(ctx context.Context, dm *devices.Device) error {
	if err := devices.SetQueueIfNoPath(dm, false); err != nil {
		return err
	}
	qctx, cancel := context.WithTimeout(ctx, multipathdWait)
	defer cancel()
	if _, err := t.run.run(qctx, t.opts.Multipathd, "disablequeueing", "map", mapName(dm)); err != nil {
		logctx.From(ctx, t.log).Debug("multipathd disablequeueing", "map", mapName(dm), "error", err)
	}
	return nil
}

// multipathdWait bounds a request to multipathd that berth can do
// without (device-mapper has done the work already).
const multipathdWait = 3 * time.Second

// removeMap stops the map from queueing I/O (so that its flush cannot hang
// on dead paths) and removes it.
func (t *Transport) removeMap(ctx context.Context, dm *devices.Device) error {
	if err := t.failQueueing(ctx, dm); err != nil {
		return fmt.Errorf("remove multipath map %s (%s): %w", mapName(dm), dm.Path, err)
	}
	if err := devices.RemoveMultipathMap(ctx, t.opts.Listener, dm); err != nil {
		return fmt.Errorf("remove multipath map %s (%s): %w", mapName(dm), dm.Path, err)
	}
	return nil
}

// sizeMatcher matches a device once it has size bytes.
type sizeMatcher struct {
	name string
	size int64
}

func (m sizeMatcher) Match(d *devices.Device) bool {
	return d != nil && d.Name == m.name && d.Size == m.size
}
func (m sizeMatcher) String() string { return fmt.Sprintf("%s with %d bytes", m.name, m.size) }

// resizeMap has multipathd grow the map to the paths' size and waits for
// the map's change event.
func (t *Transport) resizeMap(ctx context.Context, dm *devices.Device, size int64) (int64, error) {
	w := t.opts.Listener.Subscribe(sizeMatcher{name: dm.Name, size: size})
	defer w.Close()
	out, err := t.run.run(ctx, t.opts.Multipathd, "resize", "map", mapName(dm))
	if err == nil && strings.Contains(strings.ToLower(string(out)), "fail") {
		err = fmt.Errorf("multipathd answered %q", strings.TrimSpace(string(out)))
	}
	if err != nil {
		return 0, fmt.Errorf("resize multipath map %s to %d bytes: %w", mapName(dm), size, errors.Join(err, errdefs.ErrUnavailable))
	}
	wctx, cancel := context.WithTimeout(ctx, mapWait)
	defer cancel()
	d, err := w.Wait(wctx)
	if err != nil {
		return 0, fmt.Errorf("multipath map %s did not reach %d bytes: %w", mapName(dm), size, err)
	}
	return d.Size, nil
}
