package devices

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// nvmePassthruCmd is struct nvme_passthru_cmd of linux/nvme_ioctl.h (72
// bytes, the same layout on every 64-bit architecture).
type nvmePassthruCmd struct {
	opcode      uint8
	flags       uint8
	rsvd1       uint16
	nsid        uint32
	cdw2        uint32
	cdw3        uint32
	metadata    uint64
	addr        uint64
	metadataLen uint32
	dataLen     uint32
	cdw10       uint32
	cdw11       uint32
	cdw12       uint32
	cdw13       uint32
	cdw14       uint32
	cdw15       uint32
	timeoutMS   uint32
	result      uint32
}

const (
	// nvmeIoctlID is NVME_IOCTL_ID, _IO('N', 0x40): the namespace ID of
	// a namespace block device, as the ioctl's return value.
	nvmeIoctlID = 0x4e40
	// nvmeIoctlIOCmd is NVME_IOCTL_IO_CMD, _IOWR('N', 0x43, struct
	// nvme_passthru_cmd).
	nvmeIoctlIOCmd = 0xc0484e43

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

// nvmeReservationReport says whether the agent may rely on NVMe
// reservations: readReservationNVMe reads the Reservation Report, but a
// node also needs an NVMe unregister (IOC_PR_REGISTER to key 0 replaces the
// key with 0 on NVMe, the host stays a registrant) before its volumes are
// fenced. Until then ReservationReadable is false for NVMe devices and the
// agent stages them unfenced, saying so.
const nvmeReservationReport = false

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
			return r, nil
		}
		size = need
	}
	return Reservation{}, fmt.Errorf("reservation report of %s: the registrant count keeps changing: %w",
		f.Name(), errdefs.ErrBusy)
}

// nvmeNamespaceID returns the namespace ID of the namespace block device f.
func nvmeNamespaceID(f *os.File) (uint32, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nvmeIoctlID, 0)
	if errno != 0 {
		if errno == unix.ENOTTY || errno == unix.EINVAL {
			return 0, fmt.Errorf("namespace ID of %s: not an NVMe namespace (%w): %w", f.Name(), errno, errdefs.ErrUnsupported)
		}
		return 0, fmt.Errorf("namespace ID of %s: %w", f.Name(), errno)
	}
	return uint32(r), nil
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

// nvmeIOCmd sends cmd with the data buffer buf (from or to the device, as
// the opcode says) through the NVMe I/O passthrough ioctl.
func nvmeIOCmd(f *os.File, cmd *nvmePassthruCmd, buf []byte) error {
	cmd.addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
	cmd.dataLen = uint32(len(buf))
	status, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nvmeIoctlIOCmd, uintptr(unsafe.Pointer(cmd)))
	runtime.KeepAlive(buf)
	if errno != 0 {
		if errno == unix.ENOTTY {
			return fmt.Errorf("no NVMe passthrough (%w): %w", errno, errdefs.ErrUnsupported)
		}
		return errno
	}
	if status != 0 {
		return nvmeStatusError(uint32(status))
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
