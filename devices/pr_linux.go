package devices

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// The block layer's persistent-reservation ioctls (linux/pr.h). x/sys
// has none of them; the numbers are _IOW('p', 200…205) of the structs
// below and _IOWR/_IOR('p', 206/207) for the reads of kernel 6.19
// (pr_test.go checks them against the header's formula).
const (
	iocPRRegister        = 0x401870c8
	iocPRReserve         = 0x401070c9
	iocPRRelease         = 0x401070ca
	iocPRPreempt         = 0x401870cb
	iocPRPreemptAbort    = 0x401870cc
	iocPRClear           = 0x401070cd
	iocPRReadKeys        = 0xc01070ce
	iocPRReadReservation = 0x801070cf

	prFlIgnoreKey = 1 // PR_FL_IGNORE_KEY
)

type prRegistration struct {
	OldKey, NewKey uint64
	Flags, _       uint32
}

type prReservation struct {
	Key         uint64
	Type, Flags uint32
}

type prPreempt struct {
	OldKey, NewKey uint64
	Type, Flags    uint32
}

type prClear struct {
	Key      uint64
	Flags, _ uint32
}

type prReadKeys struct {
	Generation, NumKeys uint32
	KeysPtr             uint64
}

type prReadReservation struct {
	Key              uint64
	Generation, Type uint32
}

// PR is a block device opened for persistent-reservation commands. The
// commands go to the device the kernel resolves: an sd disk's LUN, an
// NVMe head's namespace (through one of its controllers), a dm-multipath
// map's paths (REGISTER on every path, the others through one).
type PR struct {
	f   *os.File
	dev *Device
}

// OpenPR opens d for reservation commands and checks that its node is
// still d (device number). It opens d for reading: the block layer takes
// PR ioctls from CAP_SYS_ADMIN on any descriptor (without it, only on one
// opened for writing, since 6.5), and udevd watches disk nodes: the close
// of a descriptor opened for writing makes it send a change event and
// probe the whole device again, in the middle of a stage.
func OpenPR(d *Device) (*PR, error) {
	f, err := os.OpenFile(d.Path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s for reservations: %w", d.Path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("stat %s: %w", d.Path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(st.Rdev) != d.Major || unix.Minor(st.Rdev) != d.Minor {
		f.Close()
		return nil, errdefs.FailedPrecondition("%s: no longer block device %d:%d", d.Path, d.Major, d.Minor)
	}
	return &PR{f: f, dev: d}, nil
}

// Close closes the device.
func (p *PR) Close() error { return p.f.Close() }

// Register registers newKey for this I_T nexus (each path of a
// dm-multipath map). ignoreExisting replaces whatever key the nexus has
// (REGISTER AND IGNORE EXISTING KEY); newKey 0 unregisters it.
//
// On NVMe, newKey 0 unregisters through the Reservation Register
// passthrough (Unregister action): the block layer would replace the key
// with 0 and leave the host a registrant that writes.
//
// Every REGISTER the kernel sends asks the target to keep the
// registrations and the reservation through a power loss (sd sets SCSI's
// APTPL bit, nvme sets PTPL); linux/pr.h has no flag to ask otherwise,
// and fencing wants it: a target that keeps that state (LIO in its
// dbroot's pr directory; nvmet keeps none) still fences the old holder's
// node after it restarts.
func (p *PR) Register(oldKey, newKey uint64, ignoreExisting bool) error {
	if p.dev.ID.Kind == KindNVMe && newKey == 0 {
		if ignoreExisting {
			return fmt.Errorf("register %s: an unregistration that ignores the existing key: %w", p.dev.Path, errdefs.ErrUnsupported)
		}
		if err := unregisterNVMe(p.f, oldKey); err != nil {
			return fmt.Errorf("register %s: %w", p.dev.Path, err)
		}
		return nil
	}
	r := prRegistration{OldKey: oldKey, NewKey: newKey}
	if ignoreExisting {
		r.Flags = prFlIgnoreKey
	}
	return p.prErr("register", ioctlPR(p.f, iocPRRegister, &r))
}

// Reserve takes a reservation of type t with key, which must be
// registered on the nexus.
func (p *PR) Reserve(key uint64, t PRType) error {
	r := prReservation{Key: key, Type: uint32(t)}
	return p.prErr("reserve", ioctlPR(p.f, iocPRReserve, &r))
}

// Release releases the reservation of type t that key holds.
func (p *PR) Release(key uint64, t PRType) error {
	r := prReservation{Key: key, Type: uint32(t)}
	return p.prErr("release", ioctlPR(p.f, iocPRRelease, &r))
}

// Preempt removes every registration of victim and, when victim holds the
// reservation, makes key (registered on this nexus) its holder with type
// t. abort also aborts the commands the preempted nexuses have queued at
// the target (PREEMPT AND ABORT), so that none of them lands after.
func (p *PR) Preempt(key, victim uint64, t PRType, abort bool) error {
	r := prPreempt{OldKey: key, NewKey: victim, Type: uint32(t)}
	req, op := uint(iocPRPreempt), "preempt"
	if abort {
		req, op = iocPRPreemptAbort, "preempt and abort"
	}
	return p.prErr(op, ioctlPR(p.f, req, &r))
}

// prReadIoctls caches whether the kernel has IOC_PR_READ_KEYS and
// IOC_PR_READ_RESERVATION (6.19): 0 not probed, 1 yes, 2 no.
var prReadIoctls atomic.Int32

// ReadReservation reads the registered keys and the reservation: through
// the block layer's read ioctls where the kernel has them, otherwise
// through the transport (PERSISTENT RESERVE IN over SG_IO for an sd disk
// or a dm-multipath map over sd paths, the Reservation Report for NVMe).
//
// An NVMe device is always read with the Reservation Report: unlike the
// read ioctls it names this host's registration (OwnKnown).
func (p *PR) ReadReservation() (Reservation, error) {
	if p.dev.ID.Kind != KindNVMe && prReadIoctls.Load() != 2 {
		r, err := p.readIoctl()
		switch {
		case errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EINVAL):
			// An ioctl the kernel does not know: ENOTTY from the block
			// layer, EINVAL from sd's scsi_ioctl before 6.19.
			prReadIoctls.Store(2)
		case err != nil:
			return Reservation{}, p.prErr("read reservation", err)
		default:
			prReadIoctls.Store(1)
			return r, nil
		}
	}
	var r Reservation
	var err error
	if p.dev.ID.Kind == KindNVMe {
		r, err = readReservationNVMe(p.f)
	} else {
		r, err = readReservationSCSI(p.f)
	}
	if err != nil {
		return Reservation{}, fmt.Errorf("read the reservation of %s: %w", p.dev.Path, err)
	}
	return r, nil
}

func (p *PR) readIoctl() (Reservation, error) {
	keys := make([]uint64, 16)
	var rk prReadKeys
	for {
		rk = prReadKeys{NumKeys: uint32(len(keys)), KeysPtr: uint64(uintptr(unsafe.Pointer(&keys[0])))}
		if err := ioctlPR(p.f, iocPRReadKeys, &rk); err != nil {
			return Reservation{}, err
		}
		if int(rk.NumKeys) <= len(keys) {
			break
		}
		keys = make([]uint64, rk.NumKeys)
	}
	var rr prReadReservation
	if err := ioctlPR(p.f, iocPRReadReservation, &rr); err != nil {
		return Reservation{}, err
	}
	r := Reservation{Generation: rk.Generation, Keys: keys[:rk.NumKeys:rk.NumKeys], Holder: rr.Key, Type: PRType(rr.Type)}
	if r.Type == 0 {
		r.Holder = 0
	}
	return r, nil
}

// ReservationReadable reports whether berth can read d's reservation
// (ReadReservation): SCSI disks and dm-multipath maps always; an NVMe
// namespace (head) unless its controller says it has no reservations at
// all (Identify Controller ONCS, as nvmet before Linux 6.13 answers): such
// a volume stages unfenced and says so. When that cannot be asked, the
// reservation is read, and its error says why.
func ReservationReadable(d *Device) bool {
	switch d.ID.Kind {
	case KindSCSI, KindDM:
		return true
	case KindNVMe:
		return nvmeHasReservations(d.Path)
	}
	return false
}

// ioctlPR issues a PR ioctl. Kernels before 6.2 return a SCSI result (a
// positive number) from sd rather than an errno; scsiResultError names
// it. A CHECK CONDITION is tried again, twice at most: the kernel does not
// pass the sense data of a PR command on, and the usual one is a UNIT
// ATTENTION that the target reports once to each I_T nexus after an event
// (a session logged in again when iscsid restarted, a LUN reset), which
// the command sent again does not get; a target without reservations
// answers the same each time.
func ioctlPR[T any](f *os.File, req uint, arg *T) error {
	var r uintptr
	var errno unix.Errno
	for attempt := 0; ; attempt++ {
		r, _, errno = unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(arg)))
		if errno != 0 || r&0xff != scsiStatusCheckCondition || attempt == 2 {
			break
		}
	}
	switch {
	case errno != 0:
		return errno
	case r != 0:
		return scsiResultError(int(r))
	}
	return nil
}

// prErr names the operation and maps the kernel's answer to berth's
// errors: a reservation conflict, a target or kernel that has no
// reservations. A positive answer of an NVMe device is an NVMe status
// (kernels before 6.2), not a SCSI result.
func (p *PR) prErr(op string, err error) error {
	if err == nil {
		return nil
	}
	var sr scsiResultError
	if p.dev.ID.Kind == KindNVMe && errors.As(err, &sr) {
		return fmt.Errorf("%s %s: %w", op, p.dev.Path, nvmePRResultError(uint32(sr)))
	}
	return fmt.Errorf("%s %s: %w", op, p.dev.Path, prKernelError(err))
}

func prKernelError(err error) error {
	var sr scsiResultError
	switch {
	case errors.Is(err, unix.EBADE):
		return fmt.Errorf("%w (EBADE)", ErrReservationConflict)
	case errors.As(err, &sr):
		return sr.classify()
	case errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EOPNOTSUPP):
		return fmt.Errorf("the device has no persistent reservations (%w): %w", err, errdefs.ErrUnsupported)
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
		// A missing capability stays missing until berth restarts with
		// it: FailedPrecondition, which says so, not Internal.
		return fmt.Errorf("%w: berth runs without a capability the kernel asks for here: CAP_SYS_ADMIN for the reservation commands, "+
			"CAP_SYS_RAWIO to read an iSCSI LUN's reservation (PERSISTENT RESERVE IN through SG_IO); berth.service grants both, "+
			"`berth doctor` checks them: %w", err, errdefs.ErrFailedPrecondition)
	}
	return err
}

// sgIOHdr is struct sg_io_hdr (scsi/sg.h) on 64-bit Linux.
type sgIOHdr struct {
	InterfaceID    int32
	DxferDirection int32
	CmdLen         uint8
	MxSbLen        uint8
	IovecCount     uint16
	DxferLen       uint32
	Dxferp         unsafe.Pointer
	Cmdp           unsafe.Pointer
	Sbp            unsafe.Pointer
	Timeout        uint32
	Flags          uint32
	PackID         int32
	UsrPtr         unsafe.Pointer
	Status         uint8
	MaskedStatus   uint8
	MsgStatus      uint8
	SbLenWr        uint8
	HostStatus     uint16
	DriverStatus   uint16
	Resid          int32
	Duration       uint32
	Info           uint32
}

const (
	sgIO           = 0x2285 // SG_IO
	sgDxferFromDev = -3     // SG_DXFER_FROM_DEV
	sgTimeoutMs    = 30000
)

// readReservationSCSI reads READ KEYS and READ RESERVATION through SG_IO
// (the sd disk's, or a dm-multipath map's, which passes it to a path).
func readReservationSCSI(f *os.File) (Reservation, error) {
	keys, err := persistentReserveIn(f, prInReadKeys)
	if err != nil {
		return Reservation{}, err
	}
	gen, list, err := parsePRInKeys(keys)
	if err != nil {
		return Reservation{}, err
	}
	res, err := persistentReserveIn(f, prInReadReservation)
	if err != nil {
		return Reservation{}, err
	}
	r, err := parsePRInReservation(res)
	if err != nil {
		return Reservation{}, err
	}
	r.Keys = list
	if r.Generation != gen {
		// Changed between the two reads: the caller reads again when
		// it needs both from one instant.
		r.Generation = gen
	}
	return r, nil
}

func persistentReserveIn(f *os.File, sa byte) ([]byte, error) {
	size := 1024
	for {
		buf := make([]byte, size)
		cdb := prInCDB(sa, uint16(size))
		sense := make([]byte, 32)
		h := sgIOHdr{
			InterfaceID: 'S', DxferDirection: sgDxferFromDev,
			CmdLen: uint8(len(cdb)), MxSbLen: uint8(len(sense)),
			DxferLen: uint32(len(buf)), Dxferp: unsafe.Pointer(&buf[0]),
			Cmdp: unsafe.Pointer(&cdb[0]), Sbp: unsafe.Pointer(&sense[0]),
			Timeout: sgTimeoutMs,
		}
		if err := ioctlPtr(f, sgIO, &h); err != nil {
			return nil, fmt.Errorf("PERSISTENT RESERVE IN: SG_IO: %w", prKernelError(err))
		}
		if err := sgStatusError(h.Status, h.HostStatus, h.DriverStatus, sense[:h.SbLenWr]); err != nil {
			return nil, fmt.Errorf("PERSISTENT RESERVE IN: %w", err)
		}
		n := len(buf) - int(h.Resid)
		if need, ok := prInLength(buf[:n]); ok && need > size && size < 1<<16-1 {
			size = min(need, 1<<16-1)
			continue
		}
		return buf[:n], nil
	}
}

func sgStatusError(status uint8, host, driver uint16, sense []byte) error {
	switch {
	case status == scsiStatusReservationConflict:
		return ErrReservationConflict
	case status == scsiStatusCheckCondition:
		return senseError(sense)
	case status != 0:
		return fmt.Errorf("SCSI status %#x", status)
	case host != 0 || driver&^0x08 != 0: // DRIVER_SENSE alone goes with a check condition
		return fmt.Errorf("host status %#x, driver status %#x: %w", host, driver, errdefs.ErrUnavailable)
	}
	return nil
}
