//go:build !linux

package lockfile

import (
	"fmt"
	"runtime"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Acquire is only supported on Linux.
func Acquire(path string) (*Lock, error) {
	return nil, fmt.Errorf("lock %s: not supported on %s: %w", path, runtime.GOOS, errdefs.ErrUnsupported)
}
