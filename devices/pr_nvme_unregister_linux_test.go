//go:build linux

package devices

import (
	"encoding/binary"
	"fmt"
	"os"
)

// unregisterNVMe removes this host's registration, whose key is key, from
// the NVMe namespace block device f: a Reservation Register with the
// Unregister action. The block layer has no way to say it for NVMe:
// IOC_PR_REGISTER with a new key of 0 sends Replace (the kernel picks
// Replace for any non-zero old key), and nvmet then keeps the host
// registered with key 0, still a registrant that writes under a
// registrants-only reservation (measured on 7.3, TestVMNVMeReservations).
// Such a host gets a key again only through IOC_PR_REGISTER with
// PR_FL_IGNORE_KEY and a non-zero old key (Replace, IEKEY): with old key
// 0 the kernel sends Register, which conflicts with the key-0
// registration.
// A host that is not registered, or registered with another key, gets an
// error wrapping ErrReservationConflict. Unregistering the holder of a
// registrants-only reservation releases it.
//
// Only the tests call it so far: the NVMe unregistration of an unstage
// belongs here, in pr_nvme_linux.go, once the block-layer PR code calls
// it for NVMe devices.
func unregisterNVMe(f *os.File, key uint64) error {
	nsid, err := nvmeNamespaceID(f)
	if err != nil {
		return err
	}
	// Reservation Register data: CRKEY (current key), NRKEY (new key).
	data := make([]byte, 16)
	binary.LittleEndian.PutUint64(data[0:8], key)
	cmd := nvmePassthruCmd{
		opcode: nvmeCmdResvRegister,
		nsid:   nsid,
		cdw10:  nvmeResvRegisterUnregister,
	}
	if err := nvmeIOCmd(f, &cmd, data); err != nil {
		return fmt.Errorf("unregister key %#x from %s: %w", key, f.Name(), err)
	}
	return nil
}
