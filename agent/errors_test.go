package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestCode(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{nil, codes.OK},
		{fmt.Errorf("volume_id: missing: %w", errdefs.ErrInvalidArgument), codes.InvalidArgument},
		{fmt.Errorf("image: %w", errdefs.ErrNotFound), codes.NotFound},
		{fmt.Errorf("x: %w", errdefs.ErrAlreadyExists), codes.AlreadyExists},
		{fmt.Errorf("x: %w", errdefs.ErrFailedPrecondition), codes.FailedPrecondition},
		{fmt.Errorf("x: %w", errdefs.ErrOutOfRange), codes.OutOfRange},
		{fmt.Errorf("x: %w", errdefs.ErrResourceExhausted), codes.ResourceExhausted},
		{fmt.Errorf("x: %w", errdefs.ErrBusy), codes.Aborted},
		{fmt.Errorf("x: %w", errdefs.ErrPermissionDenied), codes.PermissionDenied},
		{fmt.Errorf("x: %w", errdefs.ErrUnavailable), codes.Unavailable},
		{fmt.Errorf("x: %w", errdefs.ErrUnsupported), codes.FailedPrecondition},
		{fmt.Errorf("wait: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("wait: %w", ctx.Err()), codes.Canceled},
		// The request's problem wins over the cleanup's.
		{errors.Join(fmt.Errorf("a: %w", errdefs.ErrBusy), fmt.Errorf("b: %w", errdefs.ErrInvalidArgument)), codes.InvalidArgument},
		// A sentinel wins over a deadline that cut the cleanup short.
		{errors.Join(fmt.Errorf("a: %w", errdefs.ErrNotFound), context.DeadlineExceeded), codes.NotFound},
		// A device that did not answer by the deadline (fs.Probe, blocking).
		{fmt.Errorf("probe: %w", errors.Join(errdefs.ErrUnavailable, context.DeadlineExceeded)), codes.Unavailable},
		{status.Error(codes.Unauthenticated, "x"), codes.Unauthenticated},
		{errors.New("mkfs crashed"), codes.Internal},
	} {
		if got := Code(tc.err); got != tc.want {
			t.Errorf("Code(%v) = %v, want %v", tc.err, got, tc.want)
		}
		if tc.err != nil {
			if got := status.Code(toStatus(tc.err, nil)); got != tc.want {
				t.Errorf("toStatus(%v) has code %v, want %v", tc.err, got, tc.want)
			}
		}
	}
}

func TestToStatusRedactsSecrets(t *testing.T) {
	err := toStatus(fmt.Errorf("login with chap secret hunter2 failed: %w", errdefs.ErrPermissionDenied), map[string]string{"password": "hunter2"})
	if strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("secret in error: %v", err)
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("code %v", status.Code(err))
	}
}
