package devices

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/berth-csi/berth/internal/errdefs"
)

// ErrReservationConflict is the target's answer to a command that another
// node's persistent reservation forbids (SCSI status RESERVATION
// CONFLICT, the kernel's EBADE, an NVMe reservation conflict). It wraps
// errdefs.ErrFailedPrecondition.
var ErrReservationConflict = fmt.Errorf("reservation conflict: %w", errdefs.ErrFailedPrecondition)

// SCSI status codes (SAM).
const (
	scsiStatusCheckCondition      = 0x02
	scsiStatusReservationConflict = 0x18
)

// PERSISTENT RESERVE IN (SPC-4 6.16) service actions.
const (
	prInReadKeys        = 0x00
	prInReadReservation = 0x01
)

// prInCDB is the 10-byte PERSISTENT RESERVE IN command for service
// action sa with allocation length n.
func prInCDB(sa byte, n uint16) []byte {
	cdb := make([]byte, 10)
	cdb[0] = 0x5e
	cdb[1] = sa & 0x1f
	binary.BigEndian.PutUint16(cdb[7:9], n)
	return cdb
}

// prInLength is the whole length of a PERSISTENT RESERVE IN answer its
// header announces (8 + ADDITIONAL LENGTH).
func prInLength(b []byte) (int, bool) {
	if len(b) < 8 {
		return 0, false
	}
	return 8 + int(binary.BigEndian.Uint32(b[4:8])), true
}

// parsePRInKeys parses the parameter data of READ KEYS: the generation
// and the registered keys. A list cut short by the allocation length is
// an error, not a shorter list.
func parsePRInKeys(b []byte) (uint32, []uint64, error) {
	if len(b) < 8 {
		return 0, nil, fmt.Errorf("READ KEYS: %d bytes, want at least 8", len(b))
	}
	gen := binary.BigEndian.Uint32(b[0:4])
	n := binary.BigEndian.Uint32(b[4:8])
	if n%8 != 0 {
		return 0, nil, fmt.Errorf("READ KEYS: additional length %d is not a multiple of 8", n)
	}
	if uint64(n) > uint64(len(b)-8) {
		return 0, nil, fmt.Errorf("READ KEYS: additional length %d, only %d bytes returned", n, len(b)-8)
	}
	keys := make([]uint64, 0, n/8)
	for off := 8; off < 8+int(n); off += 8 {
		keys = append(keys, binary.BigEndian.Uint64(b[off:off+8]))
	}
	return gen, keys, nil
}

// scsiPRTypes maps SPC's PERSISTENT RESERVE type codes to linux/pr.h's.
var scsiPRTypes = map[byte]PRType{
	1: PRWriteExclusive,
	3: PRExclusiveAccess,
	5: PRWriteExclusiveRegOnly,
	6: PRExclusiveAccessRegOnly,
	7: PRWriteExclusiveAllRegs,
	8: PRExclusiveAccessAllRegs,
}

// parsePRInReservation parses the parameter data of READ RESERVATION:
// the generation and, when the device is reserved, the holder's key and
// the type (Keys is left empty).
func parsePRInReservation(b []byte) (Reservation, error) {
	if len(b) < 8 {
		return Reservation{}, fmt.Errorf("READ RESERVATION: %d bytes, want at least 8", len(b))
	}
	r := Reservation{Generation: binary.BigEndian.Uint32(b[0:4])}
	switch n := binary.BigEndian.Uint32(b[4:8]); {
	case n == 0:
		return r, nil
	case n < 16 || len(b) < 24:
		return Reservation{}, fmt.Errorf("READ RESERVATION: additional length %d with %d bytes, want 16 and 24", n, len(b))
	}
	t, ok := scsiPRTypes[b[21]&0x0f]
	if !ok {
		return Reservation{}, fmt.Errorf("READ RESERVATION: unknown type %#x", b[21]&0x0f)
	}
	if scope := b[21] >> 4; scope != 0 {
		return Reservation{}, fmt.Errorf("READ RESERVATION: scope %#x, want LU_SCOPE", scope)
	}
	r.Holder, r.Type = binary.BigEndian.Uint64(b[8:16]), t
	return r, nil
}

// scsiResultError is the SCSI result that sd's PR ioctls return on
// kernels before 6.2 in place of an errno (status in the low byte, host
// byte in bits 16 to 23).
type scsiResultError int

func (e scsiResultError) Error() string { return fmt.Sprintf("SCSI result %#x", int(e)) }

func (e scsiResultError) classify() error {
	switch status, host := int(e)&0xff, (int(e)>>16)&0xff; {
	case status == scsiStatusReservationConflict:
		return fmt.Errorf("%w (%v)", ErrReservationConflict, e)
	case status == scsiStatusCheckCondition:
		// sd does not hand the sense data to the ioctl: an illegal
		// request and a transient failure look alike here.
		return fmt.Errorf("%v: check condition (a target without persistent reservations answers so, and so does one that failed the command)", e)
	case host != 0:
		return fmt.Errorf("%v: transport failure: %w", e, errdefs.ErrUnavailable)
	}
	return e
}

// senseError describes the sense data of a CHECK CONDITION. ILLEGAL
// REQUEST (a target that does not implement the command) wraps
// errdefs.ErrUnsupported.
func senseError(sense []byte) error {
	key, asc, ascq, ok := parseSense(sense)
	switch {
	case !ok:
		return errors.New("check condition without sense data")
	case key == 0x5:
		return fmt.Errorf("illegal request (ASC/ASCQ %#02x/%#02x): the target has no persistent reservations: %w", asc, ascq, errdefs.ErrUnsupported)
	case key == 0x6:
		return fmt.Errorf("unit attention (ASC/ASCQ %#02x/%#02x): %w", asc, ascq, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("check condition: sense key %#x, ASC/ASCQ %#02x/%#02x", key, asc, ascq)
}

// parseSense reads the sense key and additional sense code of fixed
// (0x70, 0x71) or descriptor (0x72, 0x73) sense data.
func parseSense(b []byte) (key, asc, ascq byte, ok bool) {
	if len(b) < 1 {
		return 0, 0, 0, false
	}
	switch b[0] & 0x7f {
	case 0x70, 0x71:
		if len(b) < 14 {
			return 0, 0, 0, false
		}
		return b[2] & 0x0f, b[12], b[13], true
	case 0x72, 0x73:
		if len(b) < 4 {
			return 0, 0, 0, false
		}
		return b[1] & 0x0f, b[2], b[3], true
	}
	return 0, 0, 0, false
}
