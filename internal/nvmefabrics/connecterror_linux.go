package nvmefabrics

import (
	"errors"

	"golang.org/x/sys/unix"
)

// ConnectError is a connect the kernel refused: Err is the failed write
// to the connect interface.
type ConnectError struct {
	Err error
}

func (e *ConnectError) Error() string { return e.Err.Error() }

func (e *ConnectError) Unwrap() error { return e.Err }

// Errno is the kernel's answer to the connect, 0 when the write failed
// without one.
func (e *ConnectError) Errno() unix.Errno {
	var errno unix.Errno
	errors.As(e.Err, &errno)
	return errno
}

// Reason is what the kernel's answer to a connect means.
type Reason int

const (
	// Other is an answer that means nothing more than its errno.
	Other Reason = iota
	// Duplicate: a controller with the same options exists already
	// (EALREADY, EBUSY).
	Duplicate
	// Refused: no listener at the address and port (ECONNREFUSED).
	// Kernels before 6.7 also answer a failed DH-HMAC-CHAP
	// authentication so; newer ones say AuthFailed.
	Refused
	// AuthFailed: DH-HMAC-CHAP authentication failed (EKEYREJECTED): the
	// target rejected the host key, or the controller did not prove its
	// key.
	AuthFailed
	// NoKey: the target requires DH-HMAC-CHAP authentication and the
	// connect gave no key (ENOKEY).
	NoKey
	// AuthUnsupported: the target requires in-band authentication, which
	// the kernel was built without (EPROTONOSUPPORT).
	AuthUnsupported
	// NoHandshake: with tls, the kernel's handshake upcall found no
	// tlshd listening (ESRCH).
	NoHandshake
	// Unreachable: the path did not answer (ETIMEDOUT, EHOSTUNREACH,
	// ENETUNREACH, EHOSTDOWN): no SYN-ACK, after one SYN retry. With
	// tls, ETIMEDOUT is also a TLS handshake that failed.
	Unreachable
	// NoInitResponse: the target accepted the TCP connection but never
	// answered the NVMe/TCP initialization (EAGAIN: nvme-tcp's wait for
	// the ICResp ended, its receive timeout).
	NoInitResponse
	// OptionsRejected: the kernel rejected the connect options (EINVAL).
	OptionsRejected
	// Reset: the target reset the connection (ECONNRESET). Measured on
	// 6.12: a connect without tls to an nvmet port that requires TLS
	// (addr_treq "required").
	Reset
	// Rejected: the target rejected the connect (EIO, EPROTO). EIO is
	// also what 6.12 answers, after its 60 s admin timeout, when the
	// target dropped the connection over a rejected key while the host
	// waited for its authentication reply (measured on 6.12.117 against
	// nvmet, about one rejection in three).
	Rejected
	// Exhausted: the kernel ran out of memory or of another resource
	// (ENOMEM, ENOSPC).
	Exhausted
)

// Reason says what the kernel's answer means.
func (e *ConnectError) Reason() Reason {
	switch e.Errno() {
	case unix.EALREADY, unix.EBUSY:
		return Duplicate
	case unix.ECONNREFUSED:
		return Refused
	case unix.EKEYREJECTED:
		return AuthFailed
	case unix.ENOKEY:
		return NoKey
	case unix.EPROTONOSUPPORT:
		return AuthUnsupported
	case unix.ESRCH:
		return NoHandshake
	case unix.ETIMEDOUT, unix.EHOSTUNREACH, unix.ENETUNREACH, unix.EHOSTDOWN:
		return Unreachable
	case unix.EAGAIN:
		return NoInitResponse
	case unix.EINVAL:
		return OptionsRejected
	case unix.ECONNRESET:
		return Reset
	case unix.EIO, unix.EPROTO:
		return Rejected
	case unix.ENOMEM, unix.ENOSPC:
		return Exhausted
	}
	return Other
}
