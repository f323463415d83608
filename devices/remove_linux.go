package devices

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// defaultRemoveWait bounds a removal whose context has no deadline.
const defaultRemoveWait = 60 * time.Second

// Transient openers (udev's blkid, a monitoring agent) can hold a map for a
// moment after its last real user left; DM_DEV_REMOVE then answers EBUSY.
// After a path came back, the map's reload and its change events keep
// udev opening it for a while longer. The removal is retried for up to
// dmRemoveWait, at dmRemoveBackoff growing to 8 times that.
const (
	dmRemoveWait    = 3 * time.Second
	dmRemoveBackoff = 50 * time.Millisecond
)

// current re-reads dev and reports whether it still exists as the same
// device (same number, identity and medium).
func current(dev *Device) (*Device, bool, error) {
	cur, err := dev.roots.Lookup(dev.Name)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, false, nil
		}
		return nil, false, err
	}
	if dev.diff(cur) != "" {
		return cur, false, nil
	}
	return cur, true, nil
}

func removeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, defaultRemoveWait)
}

// RemoveSCSIDevice flushes the SCSI disk dev and deletes it from the kernel
// (device/delete in sysfs), then waits for it to be gone. A disk that no
// longer exists, or whose name now belongs to another disk, counts as
// removed. A disk still held by a map (multipath) is refused with an error
// wrapping errdefs.ErrBusy: remove the map first; so is one still mounted
// or opened exclusively (InUse). A disk whose SCSI state is
// not "running" (its session is gone) is not flushed, as nothing could be
// written to it.
func RemoveSCSIDevice(ctx context.Context, l *Listener, dev *Device) error {
	if dev == nil || dev.ID.Kind != KindSCSI || checkName(dev.Name) != nil {
		return fmt.Errorf("remove SCSI device: %v is not a SCSI disk: %w", dev, errdefs.ErrInvalidArgument)
	}
	if l == nil {
		return fmt.Errorf("remove SCSI device %s: no uevent listener: %w", dev.Path, errdefs.ErrInvalidArgument)
	}
	ctx, cancel := removeContext(ctx)
	defer cancel()
	cur, same, err := current(dev)
	if err != nil {
		return fmt.Errorf("remove SCSI device %s: %w", dev.Path, err)
	}
	if !same {
		return nil
	}
	if holders, _ := dev.roots.Holders(dev.Name); len(holders) > 0 {
		return fmt.Errorf("remove SCSI device %s: held by %s; remove the multipath map first: %w",
			dev.Path, strings.Join(holders, ", "), errdefs.ErrBusy)
	}
	if err := InUse(cur); err != nil {
		return fmt.Errorf("remove SCSI device %s: %w", dev.Path, err)
	}
	if state, _ := readAttr(cur.sysPath, "device/state"); state == "running" {
		if err := FlushDevice(ctx, cur); err != nil {
			return fmt.Errorf("remove SCSI device %s (%s): %w", dev.Path, dev.ID.HCTL, err)
		}
	}
	w := l.subscribeRemoval(cur)
	defer w.Close()
	del := filepath.Join(cur.sysPath, "device", "delete")
	if err := os.WriteFile(del, []byte("1"), 0o200); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove SCSI device %s (%s): write %s: %w", dev.Path, dev.ID.HCTL, del, err)
	}
	if _, err := w.Wait(ctx); err != nil {
		return fmt.Errorf("remove SCSI device %s (%s): %w", dev.Path, dev.ID.HCTL, err)
	}
	return nil
}

// RemoveMultipathMap flushes and removes the dm-multipath map dm through
// device-mapper ioctls, and waits until it is gone; its paths stay, to be
// removed next (RemoveSCSIDevice) or by the transport's logout.
//
// Before flushing, the map is told to fail I/O instead of queueing it when
// no path is left (the "fail_if_no_path" message), so that the flush cannot
// hang on dead paths; the volume is unmounted by then, so nothing is lost
// that the flush could still write; a map without a working path is not
// flushed at all. A map that something holds (a mount, a partition map, an
// exclusive opener) is refused first, its queueing untouched, with an
// error wrapping errdefs.ErrBusy that names the holder (InUse); other
// openers, such as udev's probes, are waited out with a few brief retries. A map that no longer exists counts as removed.
//
// DM ioctls are used rather than `multipath -f` or `dmsetup remove --retry`:
// they need no tool in the agent's image, report errors as errno, and work
// whether or not multipathd runs. When multipathd runs it sees the map's
// remove event and stops tracking it.
func RemoveMultipathMap(ctx context.Context, l *Listener, dm *Device) error {
	if dm == nil || dm.ID.Kind != KindDM || !strings.HasPrefix(dm.ID.WWID, multipathUUIDPrefix) || checkName(dm.Name) != nil {
		return fmt.Errorf("remove multipath map: %v is not a multipath map: %w", dm, errdefs.ErrInvalidArgument)
	}
	if l == nil {
		return fmt.Errorf("remove multipath map %s: no uevent listener: %w", dm.Path, errdefs.ErrInvalidArgument)
	}
	ctx, cancel := removeContext(ctx)
	defer cancel()
	fail := func(err error) error {
		return fmt.Errorf("remove multipath map %s (%s): %w", dm.ID.DMName, dm.Path, err)
	}
	cur, same, err := current(dm)
	if err != nil {
		return fail(err)
	}
	if !same {
		return nil
	}
	if holders, _ := dm.roots.Holders(dm.Name); len(holders) > 0 {
		return fail(fmt.Errorf("held by %s: %w", strings.Join(holders, ", "), errdefs.ErrBusy))
	}
	if err := InUse(cur); err != nil {
		return fail(err)
	}
	if err := cur.roots.dmTargetMessage(cur.Major, cur.Minor, "fail_if_no_path"); err != nil && !errors.Is(err, unix.ENXIO) {
		return fail(err)
	}
	// Without a working path the flush could only fail: what was not
	// written is lost already.
	if paths, err := MultipathPaths(cur); err != nil || slices.ContainsFunc(paths, PathState.Working) {
		if err := FlushDevice(ctx, cur); err != nil {
			return fail(err)
		}
	}
	w := l.subscribeRemoval(cur)
	defer w.Close()
	start, backoff := time.Now(), dmRemoveBackoff
	for attempt := 1; ; attempt++ {
		err := cur.roots.dmRemove(cur.Major, cur.Minor)
		if err == nil || errors.Is(err, unix.ENXIO) {
			break
		}
		if !errors.Is(err, unix.EBUSY) {
			return fail(err)
		}
		if time.Since(start)+backoff > dmRemoveWait {
			n, _ := cur.roots.dmOpenCount(cur.Major, cur.Minor)
			return fail(fmt.Errorf("still open %d time(s) after %d attempts in %v (mounted, or used by a process: check `fuser -vm %s`): %w",
				n, attempt, time.Since(start).Round(time.Millisecond), dm.Path, errdefs.ErrBusy))
		}
		t := time.NewTimer(backoff)
		backoff = min(2*backoff, 8*dmRemoveBackoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fail(ctx.Err())
		}
	}
	if _, err := w.Wait(ctx); err != nil {
		return fail(err)
	}
	return nil
}
