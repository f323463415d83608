package iscsi

import (
	"context"
	"fmt"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Expand rescans every path of the LUN, resizes its multipath map and
// returns the new size once every path and the map report it.
func (tg *Target) Expand(ctx context.Context) (int64, error) {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return 0, err
	}
	var size int64 = -1
	for _, pd := range pds {
		if pd.dev == nil {
			continue
		}
		if err := t.rescanPath(ctx, v, pd); err != nil {
			return 0, fmt.Errorf("rescan %s (%s): %w", pd.dev.Path, pd.hctl, err)
		}
		// The rescan write returns after READ CAPACITY: the size is
		// current now.
		d, err := t.devs.Lookup(pd.dev.Name)
		if err != nil {
			return 0, err
		}
		if size >= 0 && d.Size != size {
			return 0, fmt.Errorf("iSCSI %s LUN %d: path %s reports %d bytes, another path %d: %w", v.IQN, v.LUN, d.Path, d.Size, size, errdefs.ErrUnavailable)
		}
		size = d.Size
	}
	if size < 0 {
		return 0, fmt.Errorf("iSCSI %s LUN %d is not attached on this node: %w", v.IQN, v.LUN, errdefs.ErrNotFound)
	}
	dm := t.mapOf(pds)
	if dm == nil {
		return size, nil
	}
	return t.resizeMap(ctx, dm, size)
}

// ExpandTo is Expand for a caller that knows the size the LUN should have:
// a LUN still smaller after the rescan (the storage has not grown it yet)
// is an error the caller may retry.
func (tg *Target) ExpandTo(ctx context.Context, minBytes int64) (int64, error) {
	size, err := tg.Expand(ctx)
	if err != nil {
		return 0, err
	}
	if size < minBytes {
		return size, fmt.Errorf("iSCSI %s LUN %d reports %d bytes after a rescan, fewer than the %d requested: grow the LUN on the storage first: %w",
			tg.v.IQN, tg.v.LUN, size, minBytes, errdefs.ErrUnavailable)
	}
	return size, nil
}

// rescanPath rescans the disk of one path under its portal's lock, so
// that a rescan left waiting for a target that does not answer keeps
// the retries of the expand from adding more.
func (t *Transport) rescanPath(ctx context.Context, v *Volume, pd *pathDevice) error {
	held, err := t.lockPath(ctx, v.IQN, pd.path, v.Iface)
	if err != nil {
		return err
	}
	defer held.Release()
	return t.rescan(ctx, held, pd.hctl)
}
