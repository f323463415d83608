package devices

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/errdefs"
)

// LO_FLAGS_READ_ONLY of <linux/loop.h>. LO_FLAGS_AUTOCLEAR is never set: a
// volume's loop device must outlive an agent restart.
const loFlagsReadOnly = 1

// loopMarker starts the lo_file_name berth gives the loop devices it
// configures. lo_file_name is only informational: the kernel reports the
// backing file (sysfs backing_file, which losetup shows) from the file
// itself and only echoes lo_file_name back through LOOP_GET_STATUS64,
// which makes it the one field berth can set at LOOP_CONFIGURE that
// survives and means nothing else (lo_crypt_name, the other free-text
// field, reads back empty on current kernels). The marker is what tells
// berth's device of an image deleted while attached, whose inode can no
// longer be compared, from an operator's device of that image; for an
// image that exists the comparison of the backing inode decides (loop
// devices attached by earlier versions of berth carry the bare path).
const loopMarker = "berth:"

// maxFreeLoopAttempts bounds the retries when another process configures
// the free loop device we were given before we do (EBUSY).
const maxFreeLoopAttempts = 16

// loopClaims holds the numbers of the loop devices this process is
// configuring right now. LOOP_CTL_GET_FREE answers the same device to
// every caller until one of them has bound it, and the kernel makes the
// others wait for that bind only to refuse them (EBUSY); attaches of this
// process therefore each take a device no other of them holds, and only
// a device taken by another process costs a retry. The lock covers the
// choice only, never an ioctl on a device or a wait.
var loopClaims = struct {
	sync.Mutex
	held map[int]struct{}
}{held: make(map[int]struct{})}

// loopConfigureMissing caches that the kernel has no LOOP_CONFIGURE (before
// 5.8); LOOP_SET_FD and LOOP_SET_STATUS64 are used instead. It is a fact
// about the running kernel, probed once for the process.
var loopConfigureMissing atomic.Bool

// DetachLoop detaches dev from its backing file. It does nothing when the
// device is already detached or now backs another file. When another opener
// (a mount, a process) still holds the device the kernel only marks it to be
// detached at the last close; DetachLoop then returns an error wrapping
// errdefs.ErrBusy, and calling it again after the holder is gone succeeds.
func DetachLoop(dev *Device) error {
	if dev == nil || dev.ID.Kind != KindLoop || checkName(dev.Name) != nil {
		return fmt.Errorf("detach loop device: %v is not a loop device: %w", dev, errdefs.ErrInvalidArgument)
	}
	if !stillBacked(dev) {
		return nil
	}
	lf, err := os.OpenFile(filepath.Join(dev.roots.dev(), dev.Name), os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENXIO) {
			return nil
		}
		return fmt.Errorf("detach %s: %w", dev.Path, err)
	}
	// Check again now that the device is held open: it cannot be rebound
	// to another file while we hold it without our seeing it below.
	if !stillBacked(dev) {
		lf.Close()
		return nil
	}
	// A device whose file's numbers were read with it (LoopRef) is
	// detached only while that file is bound to it, as the kernel says
	// through the node held open: a name alone is never enough to set
	// LOOP_CLR_FD (or, while it is held, autoclear) on another attach.
	if dev.backingIno != 0 {
		info, err := unix.IoctlLoopGetStatus64(int(lf.Fd()))
		if err != nil && !errors.Is(err, unix.ENXIO) {
			lf.Close()
			return fmt.Errorf("detach %s: LOOP_GET_STATUS64: %w", dev.Path, err)
		}
		if err != nil || info.Device != dev.backingDev || info.Inode != dev.backingIno {
			lf.Close()
			return nil // unbound, or bound to another file since
		}
	}
	err = unix.IoctlSetInt(int(lf.Fd()), unix.LOOP_CLR_FD, 0)
	lf.Close() // the kernel detaches at this last close
	if err != nil && !errors.Is(err, unix.ENXIO) {
		return fmt.Errorf("detach %s: LOOP_CLR_FD: %w", dev.Path, err)
	}
	if stillBacked(dev) {
		return fmt.Errorf("detach %s: still open (mounted or held by a process); the kernel detaches it at the last close: %w", dev.Path, errdefs.ErrBusy)
	}
	return nil
}

// transientOpenWait bounds how long DetachLoopContext waits for the last
// opener of a loop device it detached to let go; udev's probes take
// milliseconds, a mount stays.
const transientOpenWait = 3 * time.Second

// DetachLoopContext is DetachLoop for callers with a listener: when a
// short-lived opener (udev's blkid after the device changed) still holds the
// device, it waits through the listener, briefly and at most until ctx ends,
// for the kernel to finish the detach at that opener's last close, instead of
// returning errdefs.ErrBusy at once.
func DetachLoopContext(ctx context.Context, l *Listener, dev *Device) error {
	if l == nil {
		return DetachLoop(dev)
	}
	if dev == nil || dev.ID.Kind != KindLoop || checkName(dev.Name) != nil {
		return DetachLoop(dev)
	}
	w := l.subscribeUntil(dev.Name, "detach of "+dev.String(), func() bool { return !stillBacked(dev) })
	defer w.Close()
	err := DetachLoop(dev)
	if !errors.Is(err, errdefs.ErrBusy) {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, transientOpenWait)
	defer cancel()
	if _, werr := w.Wait(wctx); werr != nil {
		return fmt.Errorf("%w (waited %v for the holder to close it)", err, transientOpenWait)
	}
	return nil
}

// clearLoop detaches a loop device that AttachLoop just configured.
func (r Roots) clearLoop(name string) error {
	lf, err := os.OpenFile(filepath.Join(r.dev(), name), os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer lf.Close()
	if err := unix.IoctlSetInt(int(lf.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		return err
	}
	return nil
}

// stillBacked reports whether the loop device dev is still bound to its
// file: for a device whose file's numbers were read with it (LoopRef),
// by those numbers, through its node (the name the kernel shows changes
// with every rename of the file); for another, by that name.
func stillBacked(dev *Device) bool {
	cur, err := dev.roots.readDevice(dev.roots.block(dev.Name), KindLoop)
	if err != nil || cur.ID.BackingFile == "" || cur.Major != dev.Major || cur.Minor != dev.Minor {
		return false
	}
	if dev.backingIno != 0 {
		info, err := loopStatus(dev)
		return err == nil && info.Device == dev.backingDev && info.Inode == dev.backingIno
	}
	return cur.ID.BackingFile == dev.ID.BackingFile
}

// RefreshLoopCapacity makes the loop device take the current size of its
// backing file (LOOP_SET_CAPACITY) and returns the new size in bytes. The
// device is verified first, so a reused loop name is never resized.
func RefreshLoopCapacity(ctx context.Context, dev *Device) (int64, error) {
	if dev == nil || dev.ID.Kind != KindLoop {
		return 0, fmt.Errorf("refresh loop capacity: %v is not a loop device: %w", dev, errdefs.ErrInvalidArgument)
	}
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("refresh capacity of %s: %w", dev.Path, err)
	}
	if err := dev.Verify(); err != nil {
		return 0, fmt.Errorf("refresh capacity: %w", err)
	}
	lf, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("refresh capacity of %s: %w", dev.Path, err)
	}
	defer lf.Close()
	if err := unix.IoctlSetInt(int(lf.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return 0, fmt.Errorf("refresh capacity of %s: LOOP_SET_CAPACITY: %w", dev.Path, err)
	}
	size, err := blockdev.Size(lf)
	if err != nil {
		return 0, fmt.Errorf("refresh capacity of %s: %w", dev.Path, err)
	}
	dev.Size = size
	return size, nil
}

// LoopBackingFile opens the file the loop device d shows, for reading,
// and returns it with the device's size: d is bound to the whole file
// (offset 0, no size limit), so that the device's bytes are the file's
// first size bytes (a device larger than the file, which shrank, reads
// zeros past its end). The device's own cache is written back to the
// file first (BLKFLSBUF), so that writes through d are in the file. The
// file is opened by its name and checked to be the inode d is bound to.
//
// A nil file with a nil error means d does not show a whole file: d is
// not a loop device, is bound at an offset or with a size limit, or its
// file is deleted or has another inode under its name now.
func LoopBackingFile(d *Device) (*os.File, int64, error) {
	if d == nil || d.ID.Kind != KindLoop || d.ID.BackingFile == "" || strings.HasSuffix(d.ID.BackingFile, " (deleted)") {
		return nil, 0, nil
	}
	lf, err := openLoopChecked(d)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, 0, nil // another device has the name now
	} else if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", d.Path, err)
	}
	defer lf.Close()
	if err := blockdev.DropCache(lf); err != nil {
		return nil, 0, fmt.Errorf("%s: %w", d.Path, err)
	}
	info, err := unix.IoctlLoopGetStatus64(int(lf.Fd()))
	if err != nil {
		if errors.Is(err, unix.ENXIO) {
			return nil, 0, nil // unbound meanwhile
		}
		return nil, 0, fmt.Errorf("LOOP_GET_STATUS64 %s: %w", d.Path, err)
	}
	if loopDiff(info) != "" {
		return nil, 0, nil
	}
	size, err := blockdev.Size(lf)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", d.Path, err)
	}
	bf, err := os.OpenFile(d.ID.BackingFile, os.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, 0, nil
		}
		return nil, 0, fmt.Errorf("open %s: %w", d.ID.BackingFile, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(bf.Fd()), &st); err != nil {
		bf.Close()
		return nil, 0, fmt.Errorf("fstat %s: %w", d.ID.BackingFile, err)
	}
	if st.Dev != info.Device || st.Ino != info.Inode || st.Mode&unix.S_IFMT != unix.S_IFREG {
		bf.Close()
		return nil, 0, nil // the name means another file now
	}
	return bf, size, nil
}
