package errdefs

import (
	"errors"
	"io/fs"
	"testing"
)

// A constructor's message is the one the fmt.Errorf it stands for gives,
// it wraps the sentinel and any %w of the format, and it leaves the
// caller's arguments alone.
func TestConstructors(t *testing.T) {
	for _, tc := range []struct {
		fn       func(string, ...any) error
		sentinel error
	}{
		{InvalidArgument, ErrInvalidArgument},
		{NotFound, ErrNotFound},
		{AlreadyExists, ErrAlreadyExists},
		{FailedPrecondition, ErrFailedPrecondition},
		{Unavailable, ErrUnavailable},
	} {
		args := make([]any, 2, 3)
		args[0], args[1] = "vol", fs.ErrNotExist
		err := tc.fn("volume %q: %w", args...)
		if want := `volume "vol": file does not exist: ` + tc.sentinel.Error(); err.Error() != want {
			t.Errorf("got %q, want %q", err, want)
		}
		if !errors.Is(err, tc.sentinel) || !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%v wraps neither %v nor fs.ErrNotExist", err, tc.sentinel)
		}
		if args[:3][2] != nil {
			t.Errorf("%v wrote into the caller's arguments", tc.sentinel)
		}
	}
}
