package devices

import "fmt"

// PRType is a persistent reservation's type, numbered as the kernel's
// block layer numbers them (enum pr_type in linux/pr.h), whatever the
// transport's own encoding (SCSI's PERSISTENT RESERVE type codes, NVMe's
// reservation types).
type PRType uint8

// The reservation types of linux/pr.h.
const (
	PRWriteExclusive         PRType = 1
	PRExclusiveAccess        PRType = 2
	PRWriteExclusiveRegOnly  PRType = 3
	PRExclusiveAccessRegOnly PRType = 4
	PRWriteExclusiveAllRegs  PRType = 5
	PRExclusiveAccessAllRegs PRType = 6
)

// Reservation is a block device's persistent-reservation state as its
// target reports it.
type Reservation struct {
	// Generation is the target's PR generation counter: it changes with
	// every change of the registrations (register, replace, unregister,
	// preempt, clear); taking or releasing a reservation leaves it as it
	// is (SPC's PRgeneration; nvmet on 7.3, measured), and nvmet starts
	// it at 0 again when a namespace is enabled.
	Generation uint32
	// Keys are the registered reservation keys, one per registrant (an
	// I_T nexus for SCSI, a host for NVMe), in the target's order; a key
	// registered through several paths appears once per path for SCSI,
	// once for NVMe (nvmet keys registrants by host ID, whichever
	// controller registered).
	Keys []uint64
	// Holder is the reservation holder's key, 0 when the device is not
	// reserved. For the all-registrants types every registrant holds the
	// reservation and the targets report key 0.
	Holder uint64
	// Type is the reservation's type, 0 when the device is not reserved.
	Type PRType
	// OwnKnown says whether the transport told this host's
	// registration apart (NVMe: the registrant with this host's host
	// ID); then OwnRegistered says whether this host is a registrant
	// and OwnKey is its key, which can be 0 on NVMe (a registrant with
	// key 0 writes under a registrants-only reservation).
	OwnKnown      bool
	OwnRegistered bool
	OwnKey        uint64
}

// PRPaths are the devices through which d's registrations are made, one
// I_T nexus (or NVMe host) each: the sd disks under a dm-multipath map,
// or d itself (an sd disk, an NVMe head, whose controllers share the
// host's registration).
func PRPaths(d *Device) ([]*Device, error) {
	if d.ID.Kind != KindDM {
		return []*Device{d}, nil
	}
	names, err := d.roots.Slaves(d.Name)
	if err != nil {
		return nil, fmt.Errorf("paths of %s: %w", d.Path, err)
	}
	paths := make([]*Device, 0, len(names))
	for _, n := range names {
		p, err := d.roots.Lookup(n)
		if err != nil {
			return nil, fmt.Errorf("path %s of %s: %w", n, d.Path, err)
		}
		paths = append(paths, p)
	}
	return paths, nil
}
