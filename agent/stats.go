package agent

import (
	"context"
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

func (n *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (_ *csi.NodeGetVolumeStatsResponse, retErr error) {
	defer func() { retErr = toStatus(retErr, nil) }()
	id, p := req.GetVolumeId(), req.GetVolumePath()
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if p == "" {
		return nil, errdefs.InvalidArgument("volume_path: missing")
	}
	unlock, err := n.a.locks.tryLock(volumeKey(id))
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := n.volumePathOf(id, p)
	if err != nil {
		return nil, err
	}
	cond := n.a.condition(ctx, rec)
	resp := &csi.NodeGetVolumeStatsResponse{VolumeCondition: cond}
	if rec.AccessType == "block" {
		d := n.a.recordedDevice(rec.volumeDevice())
		if d == nil {
			cond.Abnormal, cond.Message = true, fmt.Sprintf("device %s (or its dm-crypt mapping) is gone or changed since stage", rec.Device.path())
			return resp, nil
		}
		size, err := n.a.host.BlockDeviceSize(d.Path)
		if err != nil {
			return nil, err
		}
		resp.Usage = []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}
		return resp, nil
	}
	unmounted, err := n.a.pathCondition(rec, p)
	if err != nil {
		return nil, err
	}
	if unmounted != nil {
		resp.VolumeCondition = unmounted
		return resp, nil
	}
	st, err := n.a.host.Stats(p)
	if err != nil {
		return nil, err
	}
	resp.Usage = []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: st.TotalBytes, Available: st.AvailableBytes, Used: st.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: st.TotalInodes, Available: st.FreeInodes, Used: st.UsedInodes},
	}
	return resp, nil
}

// condition reports the volume's health: the transport's view of the
// connection, then whether the device is still the one staged and the
// staging mount is in place.
func (a *Agent) condition(ctx context.Context, rec *volumeRecord) *csi.VolumeCondition {
	return a.conditionOf(ctx, rec, a.recordedTarget(rec))
}

// conditionOf is condition with the record's target already parsed (nil
// when it does not parse).
func (a *Agent) conditionOf(ctx context.Context, rec *volumeRecord, t Target) *csi.VolumeCondition {
	if !rec.Staged || rec.Device == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: "staging did not complete; the CO retries NodeStageVolume or calls NodeUnstageVolume"}
	}
	if t != nil {
		if abnormal, msg := t.Health(ctx); abnormal {
			return &csi.VolumeCondition{Abnormal: true, Message: msg}
		}
	}
	d := a.recordedDevice(rec.Device)
	if d == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("device %s is gone or changed since stage", rec.Device.path())}
	}
	if rec.Device.Size > 0 && d.Size < rec.Device.Size {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("device %s shrank from %d to %d bytes: the volume's end is gone", d.Path, rec.Device.Size, d.Size)}
	}
	if rec.Crypt != nil && a.recordedDevice(rec.Crypt.Mapping) == nil {
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("dm-crypt mapping %s of device %s is gone or changed since stage", rec.Crypt.Name, d.Path)}
	}
	if c := a.fenceCondition(rec); c != nil {
		return c
	}
	if rec.AccessType != "block" {
		if err := a.checkStagingMount(rec); err != nil {
			return &csi.VolumeCondition{Abnormal: true, Message: err.Error()}
		}
	}
	if why := rec.unfencedReason(); why != "" {
		return &csi.VolumeCondition{Abnormal: false, Message: "volume is attached and mounted; unfenced (" + why + "): the target does not keep other nodes from writing it"}
	}
	return &csi.VolumeCondition{Abnormal: false, Message: "volume is attached and mounted"}
}

// pathCondition is the condition of a mount volume's path (its staging
// path or a publish target) that does not show the volume (a lost mount,
// another mount put there), nil while it does. NodeGetVolumeStats and the
// metrics scrape both use it.
func (a *Agent) pathCondition(rec *volumeRecord, p string) (*csi.VolumeCondition, error) {
	var err error
	if p == rec.StagingPath {
		err = a.checkStagingMount(rec)
	} else {
		var mounted bool
		mounted, err = a.checkPublished(rec, p)
		if err == nil && !mounted {
			err = errdefs.FailedPrecondition("volume %q: %s is not mounted", rec.VolumeID, p)
		}
	}
	switch {
	case err == nil:
		return nil, nil
	case errors.Is(err, errdefs.ErrFailedPrecondition):
		return &csi.VolumeCondition{Abnormal: true, Message: err.Error()}, nil
	}
	return nil, err
}

// conditionAt is the condition NodeGetVolumeStats reports for the volume
// at any of paths: conditionOf, then, for a mount volume, whether each path
// still has its mount. An error checking a path makes the volume abnormal.
func (a *Agent) conditionAt(ctx context.Context, rec *volumeRecord, t Target, paths []string) *csi.VolumeCondition {
	c := a.conditionOf(ctx, rec, t)
	if c.Abnormal || rec.AccessType == "block" {
		return c
	}
	for _, p := range paths {
		u, err := a.pathCondition(rec, p)
		if err != nil {
			return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("check the mount at %s: %v", p, err)}
		}
		if u != nil {
			return u
		}
	}
	return c
}
