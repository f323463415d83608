package agent

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

// expandRequest is a NodeExpandVolume request once validated.
type expandRequest struct {
	id, path        string
	required, limit int64
	vcap            *volumeCap // nil: the request has no capability
	secrets         map[string]string
}

// NodeExpandVolume grows a volume after its storage grew: it rescans the
// device, then grows the dm-crypt mapping and the filesystem to it.
func (n *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (_ *csi.NodeExpandVolumeResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, req.GetSecrets()) }()
	er, err := n.validateExpand(req)
	if err != nil {
		return nil, err
	}
	unlock, err := n.a.locks.tryLock(volumeKey(er.id))
	if err != nil {
		return nil, err
	}
	defer unlock()
	took := newStepTimer()
	rec, target, err := n.checkExpand(er)
	if err != nil {
		return nil, err
	}
	took.mark("check")
	size, err := n.rescan(ctx, er, target)
	if err != nil {
		return nil, err
	}
	took.mark("rescan")
	if err := n.checkExpandedSize(er, rec, size); err != nil {
		return nil, err
	}
	if err := n.growVolume(ctx, er, rec, took); err != nil {
		return nil, err
	}
	old := rec.Device.Size
	rec.Device.Size = size
	if err := n.a.state.put(rec); err != nil {
		return nil, err
	}
	took.mark("record")
	logFrom(ctx, n.a.log).InfoContext(ctx, "expanded", slog.String("device", rec.Device.path()),
		slog.Int64("old_bytes", old), slog.Int64("new_bytes", size), took.attr())
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// validateExpand checks a NodeExpandVolume request before anything is
// locked or touched.
func (n *nodeServer) validateExpand(req *csi.NodeExpandVolumeRequest) (expandRequest, error) {
	e := expandRequest{id: req.GetVolumeId(), path: req.GetVolumePath(), secrets: req.GetSecrets()}
	if err := validateVolumeID(e.id); err != nil {
		return e, err
	}
	if e.path == "" {
		return e, errdefs.InvalidArgument("volume_path: missing")
	}
	e.required, e.limit = req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	switch {
	case e.required < 0 || e.limit < 0:
		return e, errdefs.InvalidArgument("capacity_range: negative size")
	case e.limit > 0 && e.required > e.limit:
		return e, errdefs.InvalidArgument("capacity_range: required_bytes %d exceeds limit_bytes %d", e.required, e.limit)
	}
	if err := validateSecrets(e.secrets); err != nil {
		return e, err
	}
	if c := req.GetVolumeCapability(); c != nil {
		v, err := validateCapability(c, n.a.host.SupportedFsTypes(), n.a.host.ParseMountOptions)
		if err != nil {
			return e, err
		}
		e.vcap = &v
	}
	return e, nil
}

// checkExpand finds the volume's record for the volume path, checks it
// against the request, and parses its target. The device must still be
// the one staged and, for a mount volume, the staging mount in place:
// the filesystem is grown through it.
func (n *nodeServer) checkExpand(e expandRequest) (*volumeRecord, Target, error) {
	id := e.id
	rec, err := n.volumePathOf(id, e.path)
	if err != nil {
		return nil, nil, err
	}
	if e.vcap != nil && e.vcap.accessType() != rec.AccessType {
		return nil, nil, errdefs.InvalidArgument("volume_capability: access type %s, the volume was staged as %s", e.vcap.accessType(), rec.AccessType)
	}
	tr, ok := n.a.transports[rec.Transport]
	if !ok {
		return nil, nil, errdefs.FailedPrecondition("volume %q: transport %q is not enabled", id, rec.Transport)
	}
	target, err := tr.Parse(rec.Context, e.secrets)
	if err != nil {
		return nil, nil, err
	}
	if n.a.recordedDevice(rec.Device) == nil {
		return nil, nil, errdefs.FailedPrecondition("volume %q: its device %s is gone or changed since stage; unstage and stage again", id, rec.Device.path())
	}
	if rec.AccessType != "block" {
		// The filesystem is grown through its staging mount.
		if err := n.a.checkStagingMount(rec); err != nil {
			return nil, nil, err
		}
	}
	return rec, target, nil
}

// rescan has the transport look at the storage's size again (growing the
// device to required_bytes where the transport can) and returns the
// device's size.
func (n *nodeServer) rescan(ctx context.Context, e expandRequest, target Target) (int64, error) {
	if e.required > 0 {
		return target.ExpandTo(ctx, e.required)
	}
	return target.Expand(ctx)
}

// checkExpandedSize checks the device after a rescan: still the volume's
// storage, not smaller than recorded, within the capacity range.
func (n *nodeServer) checkExpandedSize(e expandRequest, rec *volumeRecord, size int64) error {
	id := e.id
	// A rescan reads the storage's identity again: a LUN replaced behind
	// the same number shows only now, and its filesystem is not the
	// volume's to grow.
	if n.a.recordedDevice(rec.Device) == nil {
		return errdefs.FailedPrecondition("volume %q: its device %s changed during the rescan (the LUN or namespace was replaced?); nothing was resized: unstage and stage again", id, rec.Device.path())
	}
	if rec.Device.Size > 0 && size < rec.Device.Size {
		// The storage shrank (a LUN or namespace resized on the target):
		// the filesystem is not touched, the operator has to look.
		return errdefs.FailedPrecondition("volume %q: device %s shrank from %d to %d bytes; berth never shrinks a filesystem or grows it into a smaller device: restore the storage's size", id, rec.Device.path(), rec.Device.Size, size)
	}
	if e.required > size {
		return fmt.Errorf("volume %q: device %s holds %d bytes after a rescan, %d are required; grow the storage first: %w", id, rec.Device.path(), size, e.required, errdefs.ErrOutOfRange)
	}
	if e.limit > 0 && size > e.limit {
		return fmt.Errorf("volume %q: device %s holds %d bytes, more than limit_bytes %d: %w", id, rec.Device.path(), size, e.limit, errdefs.ErrOutOfRange)
	}
	return nil
}

// growVolume grows the dm-crypt mapping of an encrypted volume and the
// filesystem of a mount volume to the device's new size.
func (n *nodeServer) growVolume(ctx context.Context, e expandRequest, rec *volumeRecord, took *stepTimer) error {
	fsDev := rec.Device.path()
	if rec.Crypt != nil {
		m, err := n.resizeMapping(ctx, rec, e.secrets)
		if err != nil {
			return err
		}
		took.mark("resize_mapping")
		fsDev = m.Path
	}
	if rec.AccessType != "block" {
		if err := n.a.host.Resize(ctx, fsDev, rec.StagingPath, rec.FsType); err != nil {
			return err
		}
		took.mark("resize")
	}
	return nil
}
