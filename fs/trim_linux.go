package fs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// fstrimRange is struct fstrim_range of <linux/fs.h>.
type fstrimRange struct {
	Start, Len, Minlen uint64
}

// fitrim is FITRIM, _IOWR('X', 121, struct fstrim_range); x/sys/unix
// does not define it.
const fitrim = 0xc0185879

// Trim discards the blocks the filesystem whose mount root h is does not
// use (FITRIM over the whole filesystem), so that thin storage below it
// can give them back, and returns what the filesystem reports as
// trimmed: the range's length after the call, which ext4 sets to the
// free space it sent discards for and xfs leaves at the range it went
// over (the filesystem's size). The ioctl is made on a descriptor opened through h,
// never on a name looked up again. A filesystem or device that cannot
// discard wraps errdefs.ErrUnsupported; h not a mount root wraps
// errdefs.ErrInvalidArgument. FITRIM cannot be interrupted: ctx is only
// looked at before it starts.
func Trim(ctx context.Context, h *Handle) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("trim %s: %w", h.path, err)
	}
	st, err := h.Stat()
	if err != nil {
		return 0, err
	}
	if !st.MountRoot || !st.Dir {
		return 0, fmt.Errorf("trim %s: not the root of a mount: %w", h.path, errdefs.ErrInvalidArgument)
	}
	// FITRIM is refused on an O_PATH descriptor: the directory is opened
	// for reading through h's own descriptor.
	f, err := os.OpenFile(h.procPath(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("trim %s: open: %w", h.path, err)
	}
	defer f.Close()
	r := fstrimRange{Len: math.MaxUint64}
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("trim %s: %w", h.path, err)
	}
	var errno error
	if err := rc.Control(func(fd uintptr) {
		_, _, e := unix.Syscall(unix.SYS_IOCTL, fd, fitrim, uintptr(unsafe.Pointer(&r)))
		if e != 0 {
			errno = e
		}
	}); err != nil {
		return 0, fmt.Errorf("trim %s: %w", h.path, err)
	}
	switch {
	case errno == nil:
		return r.Len, nil
	case errors.Is(errno, unix.EOPNOTSUPP), errors.Is(errno, unix.ENOTTY):
		return 0, fmt.Errorf("trim %s (%s): the filesystem or its device does not support discard: %w: %w", h.path, st.FSType, errno, errdefs.ErrUnsupported)
	}
	return 0, fmt.Errorf("trim %s (%s): FITRIM: %w", h.path, st.FSType, errno)
}
