package devices

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// ioc is the kernel's _IOC (asm-generic/ioctl.h): dir in bits 30-31,
// size in 16-29, type in 8-15, number in 0-7.
func ioc(dir, typ, nr, size uintptr) uint { return uint(dir<<30 | size<<16 | typ<<8 | nr) }

func TestPRIoctlNumbers(t *testing.T) {
	const w, r = 1, 2 // _IOC_WRITE, _IOC_READ
	for _, c := range []struct {
		name string
		got  uint
		want uint
	}{
		{"IOC_PR_REGISTER", iocPRRegister, ioc(w, 'p', 200, unsafe.Sizeof(prRegistration{}))},
		{"IOC_PR_RESERVE", iocPRReserve, ioc(w, 'p', 201, unsafe.Sizeof(prReservation{}))},
		{"IOC_PR_RELEASE", iocPRRelease, ioc(w, 'p', 202, unsafe.Sizeof(prReservation{}))},
		{"IOC_PR_PREEMPT", iocPRPreempt, ioc(w, 'p', 203, unsafe.Sizeof(prPreempt{}))},
		{"IOC_PR_PREEMPT_ABORT", iocPRPreemptAbort, ioc(w, 'p', 204, unsafe.Sizeof(prPreempt{}))},
		{"IOC_PR_CLEAR", iocPRClear, ioc(w, 'p', 205, unsafe.Sizeof(prClear{}))},
		{"IOC_PR_READ_KEYS", iocPRReadKeys, ioc(w|r, 'p', 206, unsafe.Sizeof(prReadKeys{}))},
		{"IOC_PR_READ_RESERVATION", iocPRReadReservation, ioc(r, 'p', 207, unsafe.Sizeof(prReadReservation{}))},
	} {
		if c.got != c.want {
			t.Errorf("%s = %#x, the header's formula gives %#x", c.name, c.got, c.want)
		}
	}
	// struct sg_io_hdr is 88 bytes on 64-bit Linux.
	if n := unsafe.Sizeof(sgIOHdr{}); n != 88 {
		t.Errorf("sg_io_hdr: %d bytes, want 88", n)
	}
}

// Clear removes every registration and the reservation; key must be
// registered on this nexus.
func (p *PR) Clear(key uint64) error {
	r := prClear{Key: key}
	return p.prErr("clear", ioctlPR(p.f, iocPRClear, &r))
}

// A reservation command the kernel refuses for a missing capability is
// a failed precondition that names the capabilities, not an internal
// error: under a unit without CAP_SYS_RAWIO, SG_IO refuses PERSISTENT
// RESERVE IN with EPERM.
func TestPRKernelErrorPermission(t *testing.T) {
	for _, errno := range []error{unix.EPERM, unix.EACCES} {
		err := prKernelError(fmt.Errorf("SG_IO: %w", errno))
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !errors.Is(err, errno) ||
			!strings.Contains(err.Error(), "CAP_SYS_RAWIO") || !strings.Contains(err.Error(), "berth doctor") {
			t.Errorf("prKernelError(%v) = %v, want a failed precondition naming CAP_SYS_RAWIO and berth doctor", errno, err)
		}
	}
	if err := prKernelError(unix.EIO); errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("prKernelError(EIO) = %v: not a missing capability", err)
	}
}
