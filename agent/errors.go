package agent

import (
	"context"
	"errors"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
)

// errCodes lists the sentinel errors in the order they are tested. An error
// that wraps several sentinels (errors.Join of a failed step and a failed
// undo) gets the first code of this list, so the caller learns about the
// request problem before the cleanup problem.
var errCodes = []struct {
	err  error
	code codes.Code
}{
	{errdefs.ErrInvalidArgument, codes.InvalidArgument},
	{errdefs.ErrNotFound, codes.NotFound},
	{errdefs.ErrAlreadyExists, codes.AlreadyExists},
	{errdefs.ErrFailedPrecondition, codes.FailedPrecondition},
	{errdefs.ErrOutOfRange, codes.OutOfRange},
	{errdefs.ErrResourceExhausted, codes.ResourceExhausted},
	{errdefs.ErrBusy, codes.Aborted},
	{errdefs.ErrPermissionDenied, codes.PermissionDenied},
	{errdefs.ErrUnavailable, codes.Unavailable},
	// A kernel or OS without the feature: the request cannot succeed on
	// this node as it is, which is what FailedPrecondition tells the CO.
	{errdefs.ErrUnsupported, codes.FailedPrecondition},
}

// Code returns the gRPC code for an error returned by berth's packages.
// Errors that carry a gRPC status keep it; context expiry becomes
// DeadlineExceeded or Canceled; sentinel errors from internal/errdefs get
// their documented codes; anything else is Internal.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	for _, ec := range errCodes {
		if errors.Is(err, ec.err) {
			return ec.code
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Internal
}

// toStatus turns err into a gRPC status error. The values of secrets are
// replaced in the message: a lower layer that quoted a credential in an
// error must not leak it into the CO's events.
func toStatus(err error, secrets map[string]string) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(Code(err), redact(err.Error(), secrets))
}

// redact replaces every secret value found in s.
func redact(s string, secrets map[string]string) string {
	for _, v := range secrets {
		if v != "" {
			s = strings.ReplaceAll(s, v, "<redacted>")
		}
	}
	return s
}
