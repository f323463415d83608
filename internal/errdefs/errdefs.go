// Package errdefs holds the sentinel errors that berth's lower packages
// (fs, devices, iscsi, nvmeof) wrap with context. Exactly one function,
// in package agent, turns them into gRPC status codes; nothing below agent
// imports grpc/status.
//
// Wrap them with %w and a message an operator can act on, through the
// constructor named after the sentinel where there is one:
//
//	errdefs.InvalidArgument("volume_context %q: contains a comma", "nqn")
//
// is fmt.Errorf("volume_context %q: contains a comma: %w", "nqn",
// errdefs.ErrInvalidArgument).
package errdefs

import (
	"errors"
	"fmt"
)

var (
	// ErrInvalidArgument: the request itself is wrong (bad field, bad
	// format, path outside its root). Nothing was changed.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrNotFound: the volume, path, device or session does not exist.
	ErrNotFound = errors.New("not found")
	// ErrAlreadyExists: the object exists with settings that are
	// incompatible with the request (a re-stage with another fs type).
	ErrAlreadyExists = errors.New("already exists with other settings")
	// ErrFailedPrecondition: the request is valid but the system is not in
	// a state that allows it (device holds data of another kind, volume not
	// staged, published elsewhere).
	ErrFailedPrecondition = errors.New("failed precondition")
	// ErrOutOfRange: a requested size the device cannot satisfy.
	ErrOutOfRange = errors.New("out of range")
	// ErrUnavailable: the node is not ready for this kind of volume
	// (iscsid not running, module not loaded); retrying after a fix works.
	ErrUnavailable = errors.New("unavailable")
	// ErrPermissionDenied: the target refused our credentials (iSCSI CHAP,
	// NVMe DH-HMAC-CHAP), or requires credentials the request lacks.
	ErrPermissionDenied = errors.New("permission denied")
	// ErrBusy: another operation on the same object is in flight.
	ErrBusy = errors.New("operation in progress")
	// ErrResourceExhausted: a node limit (max volumes) is reached.
	ErrResourceExhausted = errors.New("resource exhausted")
	// ErrUnsupported: the feature is not supported on this OS or kernel.
	ErrUnsupported = errors.New("not supported")
)

// InvalidArgument returns the message format, a... wrapping
// ErrInvalidArgument: "<message>: invalid argument". format may itself
// hold %w verbs, and the error then wraps their errors too.
func InvalidArgument(format string, a ...any) error {
	return wrapf(ErrInvalidArgument, format, a)
}

// NotFound is InvalidArgument for ErrNotFound.
func NotFound(format string, a ...any) error { return wrapf(ErrNotFound, format, a) }

// AlreadyExists is InvalidArgument for ErrAlreadyExists.
func AlreadyExists(format string, a ...any) error { return wrapf(ErrAlreadyExists, format, a) }

// FailedPrecondition is InvalidArgument for ErrFailedPrecondition.
func FailedPrecondition(format string, a ...any) error {
	return wrapf(ErrFailedPrecondition, format, a)
}

// Unavailable is InvalidArgument for ErrUnavailable.
func Unavailable(format string, a ...any) error { return wrapf(ErrUnavailable, format, a) }

func wrapf(sentinel error, format string, a []any) error {
	return fmt.Errorf(format+": %w", append(a[:len(a):len(a)], sentinel)...)
}
