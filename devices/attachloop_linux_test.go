package devices

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// AttachLoop attaches the file named file to a loop device (tests: berth
// itself attaches a file it opened, AttachLoopFile) and returns it once it is
// usable (and, with udev, processed). When a loop device is already backed
// by file it is returned instead, so calling AttachLoop again after a crash
// does not attach the file twice; an existing device whose read-only setting
// differs gives an error wrapping errdefs.ErrAlreadyExists.
//
// The device is attached without autoclear: it stays when the agent exits,
// and DetachLoop removes it. Partition scanning stays off (a volume's
// contents are not the node's business) and so does direct I/O, which
// backing files on filesystems without O_DIRECT (tmpfs) would refuse.
func AttachLoop(ctx context.Context, l *Listener, file string, readOnly bool) (*Device, error) {
	if l == nil {
		return nil, fmt.Errorf("attach loop device for %q: no uevent listener: %w", file, errdefs.ErrInvalidArgument)
	}
	path, err := loopBackingPath(file)
	if err != nil {
		return nil, err
	}
	flags := os.O_RDWR
	if readOnly {
		flags = os.O_RDONLY
	}
	// The file is opened first: the inode it names now is the one that
	// is compared with existing loop devices and bound to a new one, even
	// if the name changes meanwhile.
	backing, err := os.OpenFile(path, flags|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		// Renamed or removed since it was looked at.
		return nil, fmt.Errorf("attach loop device: open %s: %w", path, errdefs.ErrNotFound)
	} else if err != nil {
		return nil, fmt.Errorf("attach loop device: open %s: %w", path, err)
	}
	defer backing.Close()
	return attachLoopFile(ctx, l, backing, path, readOnly)
}

func loopBackingPath(file string) (string, error) {
	if file == "" {
		return "", fmt.Errorf("loop backing file: empty path: %w", errdefs.ErrInvalidArgument)
	}
	path := canonicalFile(file)
	st, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("loop backing file %s: %w", path, errdefs.ErrNotFound)
		}
		return "", fmt.Errorf("loop backing file %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return "", fmt.Errorf("loop backing file %s: %s is not a regular file: %w", path, st.Mode().Type(), errdefs.ErrInvalidArgument)
	}
	return path, nil
}
