package nvmefabrics

import (
	"errors"
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// Each errno a connect is refused with has its meaning; the error still
// wraps the errno, and a failed write without one means nothing more.
func TestConnectErrorReason(t *testing.T) {
	for errno, want := range map[unix.Errno]Reason{
		unix.EALREADY:        Duplicate,
		unix.EBUSY:           Duplicate,
		unix.ECONNREFUSED:    Refused,
		unix.EKEYREJECTED:    AuthFailed,
		unix.ENOKEY:          NoKey,
		unix.EPROTONOSUPPORT: AuthUnsupported,
		unix.ESRCH:           NoHandshake,
		unix.ETIMEDOUT:       Unreachable,
		unix.EHOSTUNREACH:    Unreachable,
		unix.ENETUNREACH:     Unreachable,
		unix.EHOSTDOWN:       Unreachable,
		unix.EAGAIN:          NoInitResponse,
		unix.EINVAL:          OptionsRejected,
		unix.ECONNRESET:      Reset,
		unix.EIO:             Rejected,
		unix.EPROTO:          Rejected,
		unix.ENOMEM:          Exhausted,
		unix.ENOSPC:          Exhausted,
		unix.EPERM:           Other,
	} {
		e := &ConnectError{Err: fmt.Errorf("write /dev/nvme-fabrics: %w", errno)}
		if got := e.Reason(); got != want || e.Errno() != errno || !errors.Is(e, errno) {
			t.Errorf("%v: reason %d, errno %v; want %d, %v", errno, got, e.Errno(), want, errno)
		}
	}
	e := &ConnectError{Err: errors.New("short write")}
	if e.Reason() != Other || e.Errno() != 0 {
		t.Errorf("without an errno: reason %d, errno %v", e.Reason(), e.Errno())
	}
}
