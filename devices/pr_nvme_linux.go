package devices

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

const (
	nvmeAdminGetFeatures = 0x0a
	nvmeIdentifyCtrl     = 0x01 // CNS 1: Identify Controller
	nvmeIdentifyONCS     = 520  // bytes 520-521 of Identify Controller: optional NVM commands
	nvmeONCSReservations = 1 << 5
	nvmeFeatHostID       = 0x81 // Host Identifier; cdw11 bit 0 EXHID: the 128-bit one

	nvmeCmdResvRegister = 0x0d // Reservation Register
	nvmeCmdResvReport   = 0x0e // Reservation Report
	// cdw10 of a Reservation Register: RREGA (bits 2:0) 1 = Unregister;
	// CPTPL (bits 31:30) 0 = leave Persist Through Power Loss as it is.
	nvmeResvRegisterUnregister = 1
	// cdw11 bit 0 of a Reservation Report: Extended Data Structure
	// (128-bit host IDs, 64-byte registrant entries). NVMe over Fabrics
	// hosts always have 128-bit host IDs: a target may refuse the
	// 64-bit form (Host Identifier Inconsistent Format), nvmet does.
	nvmeResvReportEDS = 1 << 0

	// The extended Reservation Status data structure: a 64-byte header,
	// then one 64-byte Registrant Controller entry per registrant.
	nvmeResvHeaderLen = 64
	nvmeResvEntryLen  = 64

	// nvmeStatusMask keeps the Status Code Type and Status Code of the
	// status an NVMe passthrough ioctl returns (without More and Do Not
	// Retry).
	nvmeStatusMask        = 0x7ff
	nvmeSCInvalidOpcode   = 0x001 // the controller has no reservations (ONCS bit 5 clear)
	nvmeSCInvalidField    = 0x002 // Invalid Field in Command
	nvmeSCHostIDInconsist = 0x018 // Host Identifier Inconsistent Format
	nvmeSCResvConflict    = 0x083 // Reservation Conflict
)

// nvmeResvReportStart is the first Reservation Report buffer: the header
// and 63 registrants, one page. A larger registrant count grows it.
const nvmeResvReportStart = 4096

// readReservationNVMe reads the persistent-reservation state of the NVMe
// namespace block device f with a Reservation Report through the NVMe
// passthrough ioctl (IOC_PR_READ_RESERVATION and IOC_PR_READ_KEYS exist
// only from Linux 6.19).
//
// On a native-multipath head (/dev/nvmeXnY with NVME_MULTIPATH), the
// kernel sends a passthrough command to one path: the one its I/O policy
// picks, as for a read. Any path answers for the whole namespace, whose
// reservation state the subsystem keeps for every controller, so which
// path answers does not matter; with no usable path the ioctl fails.
func readReservationNVMe(f *os.File) (Reservation, error) {
	nsid, err := nvmeNamespaceID(f)
	if err != nil {
		return Reservation{}, err
	}
	size := nvmeResvReportStart
	// The registrant count can grow between two reports: a few tries,
	// each with the buffer the previous one said it needed.
	for range 3 {
		buf := make([]byte, size)
		if err := nvmeResvReport(f, nsid, buf); err != nil {
			return Reservation{}, err
		}
		r, need, err := parseNVMeReservationReport(buf)
		if err != nil {
			return Reservation{}, fmt.Errorf("reservation report of %s: %w", f.Name(), err)
		}
		if need <= len(buf) {
			if host, err := nvmeHostID(f); err == nil {
				r.OwnKnown = true
				r.OwnKey, r.OwnRegistered = nvmeRegistrantKey(buf, host)
			}
			return r, nil
		}
		size = need
	}
	return Reservation{}, fmt.Errorf("reservation report of %s: the registrant count keeps changing: %w",
		f.Name(), errdefs.ErrBusy)
}

// nvmeHostID returns the 128-bit host identifier the controller behind f
// knows this host by (Get Features, Host Identifier): the one the
// target's registrants are told apart by. berth connects every path with
// the host ID of /etc/nvme/hostid, so every controller of a head has it.
func nvmeHostID(f *os.File) ([16]byte, error) {
	var id [16]byte
	buf := make([]byte, len(id))
	if err := nvmeAdminCmd(f, &nvmePassthruCmd{opcode: nvmeAdminGetFeatures, cdw10: nvmeFeatHostID, cdw11: 1}, buf); err != nil {
		return id, fmt.Errorf("host identifier of %s: %w", f.Name(), err)
	}
	copy(id[:], buf)
	return id, nil
}

// nvmeHasReservations reports whether the controller of the NVMe
// namespace block device at path supports reservations: ONCS bit 5 of its
// Identify Controller data (clear on nvmet before Linux 6.13; set since,
// also for a namespace without resv_enable, whose reservation commands
// then fail and say so). It says true when it cannot ask, so that the
// reservation read reports the failure.
func nvmeHasReservations(path string) bool {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return true
	}
	defer f.Close()
	buf := make([]byte, 4096)
	if err := nvmeAdminCmd(f, &nvmePassthruCmd{opcode: nvmeAdminIdentify, cdw10: nvmeIdentifyCtrl}, buf); err != nil {
		return true
	}
	return binary.LittleEndian.Uint16(buf[nvmeIdentifyONCS:])&nvmeONCSReservations != 0
}

// nvmeRegistrantKey finds the registrant with host ID host in an
// extended Reservation Status data structure b (parsed already by
// parseNVMeReservationReport, which checked its length): its key, and
// whether there is one.
func nvmeRegistrantKey(b []byte, host [16]byte) (uint64, bool) {
	if len(b) < nvmeResvHeaderLen {
		return 0, false
	}
	n := int(binary.LittleEndian.Uint16(b[5:7]))
	for i := range n {
		off := nvmeResvHeaderLen + i*nvmeResvEntryLen
		if off+nvmeResvEntryLen > len(b) {
			break
		}
		e := b[off : off+nvmeResvEntryLen]
		if [16]byte(e[16:32]) == host {
			return binary.LittleEndian.Uint64(e[8:16]), true
		}
	}
	return 0, false
}

// nvmeResvReport fills buf with a Reservation Report (extended data
// structure) of namespace nsid.
func nvmeResvReport(f *os.File, nsid uint32, buf []byte) error {
	cmd := nvmePassthruCmd{
		opcode: nvmeCmdResvReport,
		nsid:   nsid,
		cdw10:  uint32(len(buf)/4 - 1), // NUMD: dwords to transfer, 0's based
		cdw11:  nvmeResvReportEDS,
	}
	if err := nvmeIOCmd(f, &cmd, buf); err != nil {
		return fmt.Errorf("reservation report of %s: %w", f.Name(), err)
	}
	return nil
}

// unregisterNVMe removes this host's registration, whose key is key, from
// the NVMe namespace block device f: a Reservation Register with the
// Unregister action. The block layer has no way to say it for NVMe:
// IOC_PR_REGISTER with a new key of 0 sends Replace (the kernel picks
// Replace for any non-zero old key), and nvmet then keeps the host
// registered with key 0, still a registrant that writes under a
// registrants-only reservation (measured on 7.3, TestVMNVMeReservations).
// A host that is not registered, or registered with another key, gets an
// error wrapping ErrReservationConflict. Unregistering the holder of a
// registrants-only reservation releases it.
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

// nvmeStatusError describes the NVMe status of a failed command.
func nvmeStatusError(status uint32) error {
	switch status & nvmeStatusMask {
	case nvmeSCInvalidOpcode:
		return fmt.Errorf("the target does not support reservations (NVMe status %#x, invalid opcode): %w",
			status, errdefs.ErrUnsupported)
	case nvmeSCHostIDInconsist:
		return fmt.Errorf("the target refuses the extended data structure (NVMe status %#x, host identifier inconsistent format): %w",
			status, errdefs.ErrUnsupported)
	case nvmeSCInvalidField:
		return fmt.Errorf("the controller has no reservations (NVMe status %#x, invalid field in command): %w",
			status, errdefs.ErrUnsupported)
	case nvmeSCResvConflict:
		return fmt.Errorf("%w (NVMe status %#x)", ErrReservationConflict, status)
	}
	return fmt.Errorf("NVMe status %#x: %w", status, errNVMeStatus)
}

var errNVMeStatus = errors.New("the NVMe command failed")

// prStatusConflict is PR_STS_RESERVATION_CONFLICT of linux/pr.h: since
// Linux 6.2 the PR ioctls of an NVMe device return it (a positive
// result, errno 0; 7.3 measured) for an NVMe Reservation Conflict, and
// the other PR_STS_* values (bit 16 and up) for path failures; earlier
// kernels returned the NVMe status itself (0x83, with DNR 0x4083).
const prStatusConflict = 0x18

// nvmePRResultError names the positive result of a PR ioctl on an NVMe
// device. 0x18 is taken for PR_STS_RESERVATION_CONFLICT, not for the NVMe
// status of the same number (Host Identifier Inconsistent Format, which
// Reservation Register, Acquire and Release do not return).
func nvmePRResultError(r uint32) error {
	switch {
	case r == prStatusConflict:
		return fmt.Errorf("%w (PR status %#x)", ErrReservationConflict, r)
	case r >= 1<<16:
		return fmt.Errorf("PR status %#x: path failure: %w", r, errdefs.ErrUnavailable)
	}
	return nvmeStatusError(r)
}

// parseNVMeReservationReport decodes an extended Reservation Status data
// structure (NVMe Base Specification, Reservation Report command) in b. It
// returns the reservation and the number of bytes the full report needs;
// when that exceeds len(b), the keys are those that fit and the caller
// asks again with a larger buffer.
//
// Header: GEN (bytes 0-3, little endian), RTYPE (4), REGCTL (5-6: the
// number of registrants), PTPLS (9), reserved up to byte 63. Each
// registrant (64 bytes): CNTLID (0-1; nvmet: 0xffff), RCSTS (2; bit 0:
// this registrant holds the reservation), RKEY (8-15), HOSTID (16-31).
func parseNVMeReservationReport(b []byte) (Reservation, int, error) {
	if len(b) < nvmeResvHeaderLen {
		return Reservation{}, 0, fmt.Errorf("%d bytes, want at least %d", len(b), nvmeResvHeaderLen)
	}
	r := Reservation{Generation: binary.LittleEndian.Uint32(b[0:4])}
	rtype := b[4]
	n := int(binary.LittleEndian.Uint16(b[5:7]))
	need := nvmeResvHeaderLen + n*nvmeResvEntryLen
	typ, err := prTypeFromNVMe(rtype)
	if err != nil {
		return Reservation{}, need, err
	}
	r.Type = typ
	r.Keys = make([]uint64, 0, min(n, (len(b)-nvmeResvHeaderLen)/nvmeResvEntryLen))
	holders := 0
	for i := range n {
		off := nvmeResvHeaderLen + i*nvmeResvEntryLen
		if off+nvmeResvEntryLen > len(b) {
			break
		}
		e := b[off : off+nvmeResvEntryLen]
		key := binary.LittleEndian.Uint64(e[8:16])
		r.Keys = append(r.Keys, key)
		if e[2]&1 != 0 {
			holders++
			r.Holder = key
		}
	}
	switch {
	case typ == PRWriteExclusiveAllRegs || typ == PRExclusiveAccessAllRegs:
		// Every registrant holds an all-registrants reservation; the
		// block layer (and SCSI's PERSISTENT RESERVE IN) says key 0.
		r.Holder = 0
	case typ == 0 && holders > 0:
		return Reservation{}, need, fmt.Errorf("registrant holds a reservation but the reservation type is 0")
	case typ != 0 && holders > 1:
		return Reservation{}, need, fmt.Errorf("%d registrants hold a reservation of type %d, which has one holder", holders, rtype)
	}
	return r, need, nil
}

// prTypeFromNVMe maps an NVMe reservation type (RTYPE) to the block
// layer's numbering. They are the same numbers: NVMe 1 Write Exclusive, 2
// Exclusive Access, 3 and 4 the Registrants Only, 5 and 6 the All
// Registrants variants, as enum pr_type (SCSI's type codes differ: 1, 3,
// 5, 6, 7, 8). 0 is "not reserved".
func prTypeFromNVMe(rtype uint8) (PRType, error) {
	switch PRType(rtype) {
	case 0, PRWriteExclusive, PRExclusiveAccess, PRWriteExclusiveRegOnly,
		PRExclusiveAccessRegOnly, PRWriteExclusiveAllRegs, PRExclusiveAccessAllRegs:
		return PRType(rtype), nil
	}
	return 0, fmt.Errorf("unknown NVMe reservation type %d", rtype)
}
