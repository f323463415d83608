package agent

import (
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
)

func rwName(readOnly bool) string {
	if readOnly {
		return "read-only"
	}
	return "read-write"
}

func (r *volumeRecord) publishes() map[string]publishRecord {
	if r == nil {
		return nil
	}
	return r.Publishes
}

// wantDeviceReadOnly reports whether the device of a raw block volume is
// to be read-only at the block layer: while it is published, if its
// access mode is a reader-only one or every publish is read-only. A
// read-write publish next to read-only ones makes the device writable
// through all of them; the block layer has one flag per device.
func (r *volumeRecord) wantDeviceReadOnly() bool {
	if r.AccessType != "block" || len(r.Publishes) == 0 {
		return false
	}
	if r.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY.String() ||
		r.Mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY.String() {
		return true
	}
	for _, p := range r.Publishes {
		if !p.ReadOnly {
			return false
		}
	}
	return true
}

// syncDeviceReadOnly brings the block layer's read-only flag of a raw
// block volume's device in line with its publishes. It clears only a flag
// that berth set: a device the driver holds read-only stays so. What
// berth set is recorded before setting the flag and forgotten only after
// clearing it, so that a crash in between leaves a record from which a
// retried call, or the unstage, clears it. rec is saved when it changes.
// syncRecordedReadOnly is syncDeviceReadOnly for the volume's recorded
// device, when it is still there. With no read-only publish wanted and
// the flag not set there is nothing to do, and the device is not read.
func (n *nodeServer) syncRecordedReadOnly(rec *volumeRecord) error {
	if !rec.wantDeviceReadOnly() && !rec.DeviceReadOnly {
		return nil
	}
	if d := n.a.recordedDevice(rec.volumeDevice()); d != nil {
		return n.syncDeviceReadOnly(rec, d)
	}
	return nil
}

func (n *nodeServer) syncDeviceReadOnly(rec *volumeRecord, dev *devices.Device) error {
	if !rec.wantDeviceReadOnly() {
		if !rec.DeviceReadOnly {
			return nil
		}
		if err := n.a.host.SetDeviceReadOnly(dev.Path, false); err != nil {
			return fmt.Errorf("volume %q: make device %s writable again now that no read-only publish needs it: %w", rec.VolumeID, dev.Path, err)
		}
		rec.DeviceReadOnly = false
		return n.a.state.put(rec)
	}
	if !rec.DeviceReadOnly {
		rec.DeviceReadOnly = true
		if err := n.a.state.put(rec); err != nil {
			return err
		}
	}
	if err := n.a.host.SetDeviceReadOnly(dev.Path, true); err != nil {
		return fmt.Errorf("volume %q: make device %s read-only for a read-only raw block publish (a read-only bind mount of a device node does not stop writes; berth needs CAP_SYS_ADMIN): %w", rec.VolumeID, dev.Path, err)
	}
	ro, err := n.a.host.DeviceReadOnly(dev.Path)
	if err != nil {
		return fmt.Errorf("volume %q: check that device %s is read-only: %w", rec.VolumeID, dev.Path, err)
	}
	if !ro {
		return fmt.Errorf("volume %q: device %s still accepts writes after BLKROSET; refusing a read-only raw block publish", rec.VolumeID, dev.Path)
	}
	return nil
}
