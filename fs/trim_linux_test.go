package fs

import (
	"context"
	"errors"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

// A directory that is not the root of a mount is refused before FITRIM:
// a trim through it would trim whatever filesystem holds it.
func TestTrimRefusesNonMountRoot(t *testing.T) {
	h, err := OpenPath(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if _, err := Trim(context.Background(), h); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Trim of a plain directory: %v, want ErrInvalidArgument", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Trim(ctx, h); !errors.Is(err, context.Canceled) {
		t.Fatalf("Trim with a cancelled context: %v", err)
	}
}
