package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
)

// preempted says by whom the volume's fence was taken away, "" while it
// holds (or cannot be read: the transport's health says why).
func (a *Agent) preempted(rec *volumeRecord) string {
	if rec.Fence == nil || rec.Fence.Key == 0 || a.pr == nil {
		return ""
	}
	d := a.recordedDevice(rec.Device)
	if d == nil {
		return ""
	}
	f, err := a.pr.open(d)
	if err != nil {
		return ""
	}
	defer f.Close()
	res, err := f.ReadReservation()
	if err != nil || slices.Contains(res.Keys, rec.Fence.Key) {
		return ""
	}
	if res.Holder != 0 {
		return "preempted by " + a.describeHolder(res.Holder, "")
	}
	return "this node's reservation key is no longer registered at the target"
}

// unfence gives back a volume's fence at unstage, after the unmount and
// flush and before the detach: the reservation if this node's key holds
// it, then the key on every path. A node that was preempted (its key
// gone), or whose device or paths are gone, has nothing to give back.
// Other keys are never touched. A record that may have lost its fence
// (see mayHaveLostFence) is unfenced by unfenceUnrecorded.
func (a *Agent) unfence(ctx context.Context, rec *volumeRecord, unreachable bool) error {
	if rec.Fence == nil {
		return a.unfenceUnrecorded(ctx, rec, unreachable)
	}
	if rec.Fence.Key == 0 {
		return nil
	}
	log := logFrom(ctx, a.log)
	key := rec.Fence.Key
	d := a.recordedDevice(rec.Device)
	if d == nil || unreachable {
		log.WarnContext(ctx, "the volume's device or its paths are gone: its reservation key stays registered at the target until this node stages it again or another node takes it over")
		return nil
	}
	f, err := a.pr.open(d)
	if err != nil {
		return fmt.Errorf("volume %q: give back the reservation: %w", rec.VolumeID, err)
	}
	defer f.Close()
	res, err := f.ReadReservation()
	if err != nil {
		return fmt.Errorf("volume %q: give back the reservation: %w", rec.VolumeID, err)
	}
	if !slices.Contains(res.Keys, key) {
		if res.Holder != 0 {
			log.InfoContext(ctx, "the volume was preempted: nothing to give back", slog.String("holder", a.describeHolder(res.Holder, "")))
		}
		return nil
	}
	return a.giveBack(rec, d, f, res, key)
}

// giveBack releases the reservation if key holds it and unregisters key
// on every path of d, then on the SCSI nexuses of this node that are
// gone (dropGoneNexuses).
func (a *Agent) giveBack(rec *volumeRecord, d *devices.Device, f prDevice, res devices.Reservation, key uint64) error {
	if res.Holder == key {
		if err := f.Release(key, res.Type); err != nil {
			return fmt.Errorf("volume %q: give back the reservation: %w", rec.VolumeID, err)
		}
	}
	if err := unregisterPaths(a.pr, d, key); err != nil {
		return fmt.Errorf("volume %q: unregister the node's key: %w", rec.VolumeID, err)
	}
	if d.ID.Kind == devices.KindNVMe {
		// NVMe tells registrants apart by host, not by connection.
		return nil
	}
	if err := dropGoneNexusesOf(a.pr, d, f, key); err != nil {
		return fmt.Errorf("volume %q: remove the node's key from its sessions that are gone: %w", rec.VolumeID, err)
	}
	return nil
}

// dropGoneNexusesOf runs dropGoneNexuses through one nexus of d: d
// itself (f), or on a dm-multipath map one of its paths, tried in turn.
// Through the map the commands do not keep to one nexus (the kernel
// sends a REGISTER down every path, stopping at the first that fails,
// and the others down its current path), and a RELEASE down another
// path than the PREEMPT's releases nothing, or is refused.
func dropGoneNexusesOf(h prHost, d *devices.Device, f prDevice, key uint64) error {
	if d.ID.Kind != devices.KindDM {
		return dropGoneNexuses(f, key)
	}
	paths, err := h.paths(d)
	if err != nil {
		return err
	}
	if len(paths) == 0 {
		return dropGoneNexuses(f, key)
	}
	var errs []error
	for _, p := range paths {
		pf, err := h.open(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		err = dropGoneNexuses(pf, key)
		pf.Close()
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("through %s: %w", p.Path, err))
	}
	return errors.Join(errs...)
}

// dropGoneNexuses removes key from the SCSI I_T nexuses that still have
// it once every path of the device unregistered it: this node's sessions
// that are gone (open-iscsi gives each session a new ISID), such as one
// before a reboot or one of an unstage by v0.1.0, which knows no
// fencing. One of them may hold the reservation, which a release through
// another nexus does not give back (SPC: the holder is the nexus that
// reserved). Through f registered again, a preempt of the node's own key
// removes the other nexuses' registrations (the issuing one keeps its
// own) and makes f's nexus the holder of a reservation they held; its
// release and unregistration then give everything back.
func dropGoneNexuses(f prDevice, key uint64) error {
	res, err := f.ReadReservation()
	if err != nil {
		return err
	}
	if !slices.Contains(res.Keys, key) {
		return nil
	}
	typ := fenceType
	if res.Holder == key {
		typ = res.Type
	}
	if err := f.Register(0, key, true); err != nil {
		return fmt.Errorf("register: %w", err)
	}
	if err := f.Preempt(key, key, typ, false); err != nil {
		return fmt.Errorf("preempt: %w", err)
	}
	if err := f.Release(key, typ); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	if err := f.Register(key, 0, false); err != nil {
		return fmt.Errorf("unregister: %w", err)
	}
	return nil
}

// mayHaveLostFence reports whether a record without a fence is of a
// volume that a stage fences today (a writer mode on an iSCSI, NVMe or
// multipath device): one v0.1.0 staged, which never fenced, or one whose
// record v0.1.0 wrote again after a later berth had fenced it (a
// rollback with volumes staged: its publish of a raw block volume),
// which dropped the fence it did not know.
func (rec *volumeRecord) mayHaveLostFence() bool {
	if rec.Fence != nil || rec.Device == nil {
		return false
	}
	switch rec.Device.Kind {
	case devices.KindSCSI, devices.KindNVMe, devices.KindDM:
	default:
		return false
	}
	switch csi.VolumeCapability_AccessMode_Mode(csi.VolumeCapability_AccessMode_Mode_value[rec.Mode]) {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER:
		return true
	}
	return false
}

// unfenceUnrecorded gives back the fence a record lost (see
// mayHaveLostFence). berth records a fence before it registers, and a
// device is one volume's on a node, so this node's key registered on the
// device of a record without a fence is a lost fence. Nothing recorded
// says the node holds anything: a device that cannot be read for its
// reservation is left as it is, with a warning.
func (a *Agent) unfenceUnrecorded(ctx context.Context, rec *volumeRecord, unreachable bool) error {
	if !rec.mayHaveLostFence() || a.pr == nil || unreachable {
		return nil
	}
	d := a.recordedDevice(rec.Device)
	if d == nil || !devices.ReservationReadable(d) {
		return nil
	}
	log := logFrom(ctx, a.log)
	key := NodeKey(a.cfg.NodeID)
	const unread = "the volume's record has no fence, and its device's reservation could not be read to look for this node's key, which a record v0.1.0 wrote again loses: if it is there, it stays registered until this node stages the volume again or another node takes it over"
	f, err := a.pr.open(d)
	if err != nil {
		log.WarnContext(ctx, unread, slog.String("error", err.Error()))
		return nil
	}
	defer f.Close()
	res, err := f.ReadReservation()
	if err != nil {
		log.WarnContext(ctx, unread, slog.String("error", err.Error()))
		return nil
	}
	if !slices.Contains(res.Keys, key) {
		return nil
	}
	log.WarnContext(ctx, "the node's reservation key is registered at the target though the volume's record has no fence (v0.1.0 wrote the record again and dropped the fence a later berth recorded): giving it back",
		slog.String("key", describeKey(key, a.cfg.NodeID)))
	return a.giveBack(rec, d, f, res, key)
}
