package devices

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/kmutex"
)

// AttachLoopFile attaches the regular file f to a loop device and
// returns it once it is usable (and, with udev, processed). When a loop
// device is already backed by f's inode it is returned instead, so a
// retry after a crash does not attach the file twice; an existing device
// whose read-only setting differs gives an error wrapping
// errdefs.ErrAlreadyExists.
//
// The device is attached without autoclear: it stays when the agent exits,
// and DetachLoop removes it. Partition scanning stays off (a volume's
// contents are not the node's business) and so does direct I/O, which
// backing files on filesystems without O_DIRECT (tmpfs) would refuse.
//
// f is a file the caller opened
// (read-write, or read-only for readOnly) by the name path, following no
// symbolic link: the inode f holds is what is compared with existing loop
// devices and bound to a new one, and nothing is looked up by name. path
// must be the name the kernel gives the file (its absolute path, without
// symbolic links); a device that shows it under another name (the file
// renamed meanwhile) is refused with an error wrapping
// errdefs.ErrFailedPrecondition. f stays the caller's to close.
func AttachLoopFile(ctx context.Context, l *Listener, f *os.File, path string, readOnly bool) (*Device, error) {
	if l == nil {
		return nil, fmt.Errorf("attach loop device for %q: no uevent listener: %w", path, errdefs.ErrInvalidArgument)
	}
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return nil, fmt.Errorf("attach loop device for %q: want a clean absolute path: %w", path, errdefs.ErrInvalidArgument)
	}
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("attach loop device for %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("loop backing file %s: %s is not a regular file: %w", path, fi.Mode().Type(), errdefs.ErrInvalidArgument)
	}
	return attachLoopFile(ctx, l, f, path, readOnly)
}

func attachLoopFile(ctx context.Context, l *Listener, backing *os.File, path string, readOnly bool) (_ *Device, retErr error) {
	id, err := fileIDOf(backing)
	if err != nil {
		return nil, fmt.Errorf("attach loop device: %s: %w", path, err)
	}
	// Two names of one file (hard links) wait for each other.
	unlock, err := attachLocks.Lock(ctx, id.String())
	if err != nil {
		return nil, fmt.Errorf("attach loop device for %s: %w", path, err)
	}
	defer unlock()

	if d, err := l.roots.findLoopFile(path, id, true); err == nil {
		ro, _ := readAttr(d.sysPath, "ro")
		if (ro == "1") != readOnly {
			return nil, fmt.Errorf("attach loop device for %s: %s already backs it with read-only=%t, requested %t: %w",
				path, d.Path, ro == "1", readOnly, errdefs.ErrAlreadyExists)
		}
		return d, nil
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}

	m := &loopAttachMatcher{loopMatcher: loopMatcher{file: path}}
	w := l.Subscribe(m)
	defer w.Close()

	name, err := l.configureFreeLoop(ctx, backing, path, readOnly)
	if err != nil {
		return nil, err
	}
	defer func() {
		if retErr != nil {
			if err := l.roots.clearLoop(name); err != nil {
				retErr = fmt.Errorf("%w; detaching %s again failed: %v", retErr, name, err)
			}
		}
	}()
	m.name = name
	d, err := w.Wait(ctx)
	if err != nil {
		return nil, fmt.Errorf("attach loop device %s for %s: %w", name, path, err)
	}
	if err := checkBoundTo(d, id); err != nil {
		return nil, fmt.Errorf("attach loop device for %s: %w", path, err)
	}
	// The inode opened above is bound; the kernel names it by where it
	// is now. Another name is a rename (or a removal) since the open: the
	// device would not be found again under the name asked for.
	if d.ID.BackingFile != path {
		return nil, fmt.Errorf("attach loop device for %s: the file was renamed or removed while it was being attached (the kernel names it %q now); %s was detached again: check what moves the file, then retry: %w",
			path, d.ID.BackingFile, name, errdefs.ErrFailedPrecondition)
	}
	return d, nil
}

// checkBoundTo checks that the loop device d is bound to the file id, as
// LOOP_GET_STATUS64 reports it through d's node, and records the file's
// numbers in d (see LoopRef).
func checkBoundTo(d *Device, id fileID) error {
	info, err := loopStatus(d)
	if err != nil {
		return err
	}
	if info.Device != id.dev || info.Inode != id.ino {
		return fmt.Errorf("%s: bound to file %d:%d, not to %s: %w", d.Path, info.Device, info.Inode, id, errdefs.ErrFailedPrecondition)
	}
	d.backingDev, d.backingIno = info.Device, info.Inode
	return nil
}

// loopAttachMatcher matches the loop device AttachLoop configured, by its
// name, whatever the kernel names its file: the file may be renamed after
// it was opened, and a wait for its old name would last until ctx ends.
// AttachLoop checks the device's file once it is found.
type loopAttachMatcher struct {
	loopMatcher
	name string // set after the ioctl, before Wait
}

func (m *loopAttachMatcher) Match(d *Device) bool {
	return d != nil && d.ID.Kind == KindLoop && d.ID.BackingFile != "" && m.name != "" && d.Name == m.name
}

func (m *loopAttachMatcher) String() string { return "loop device " + m.name + " bound to " + m.file }

func (m *loopAttachMatcher) deviceName() string { return m.name }

// configureFreeLoop asks loop-control for a free device, claims it (see
// loopClaims) and binds the backing file to it. Another process may take
// the same free device between the two steps; the kernel then answers
// EBUSY and we ask again. A device found by number (claimFreeLoop) may
// still be being added by another caller and not open yet (ENOENT,
// ENXIO); the next attempt then takes a device LOOP_CTL_ADD has finished
// adding.
func (l *Listener) configureFreeLoop(ctx context.Context, backing *os.File, path string, readOnly bool) (string, error) {
	ctl, err := os.OpenFile(filepath.Join(l.roots.dev(), "loop-control"), os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("attach loop device for %s: %w (is the loop module loaded?)", path, err)
	}
	defer ctl.Close()
	added := false
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return "", fmt.Errorf("attach loop device for %s: %w", path, err)
		}
		n, release, err := l.roots.claimFreeLoop(ctl, added)
		if err == nil {
			name := "loop" + strconv.Itoa(n)
			if h := l.beforeConfigure; h != nil {
				h(name)
			}
			err = l.configureLoop(name, backing, path, readOnly)
			release()
			if err == nil {
				return name, nil
			}
		}
		switch {
		case attempt == maxFreeLoopAttempts:
		case errors.Is(err, unix.EBUSY):
			added = false
			continue
		case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENXIO):
			added = true
			continue
		}
		return "", fmt.Errorf("attach loop device for %s: %w", path, err)
	}
}

// claimFreeLoop returns the number of a loop device that no other attach
// of this process is configuring and that was unbound when looked at: the
// one LOOP_CTL_GET_FREE names, or when that is claimed, the next unbound
// one after it. Past the existing devices, or with add, it is a new one
// that LOOP_CTL_ADD has finished adding. release gives the claim back. An
// error wrapping EBUSY asks the caller to try again.
func (r Roots) claimFreeLoop(ctl *os.File, add bool) (n int, release func(), err error) {
	release = func() {
		loopClaims.Lock()
		delete(loopClaims.held, n)
		loopClaims.Unlock()
	}
	if !add {
		free, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return 0, nil, fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
		}
		loopClaims.Lock()
		for n = free; ; n++ {
			if _, claimed := loopClaims.held[n]; claimed {
				continue
			}
			if n == free {
				break
			}
			sys := r.block("loop" + strconv.Itoa(n))
			if _, err := os.Lstat(sys); err != nil {
				n = -1 // past the existing devices
				break
			}
			if !loopBound(sys) {
				break
			}
		}
		if n >= 0 {
			loopClaims.held[n] = struct{}{}
			loopClaims.Unlock()
			return n, release, nil
		}
		loopClaims.Unlock()
	}
	// A number of our own choosing could be one the kernel is adding for
	// another caller right now, which cannot be opened yet; LOOP_CTL_ADD
	// with -1 picks a free number and returns once the device is added.
	ret, _, errno := unix.Syscall(unix.SYS_IOCTL, ctl.Fd(), unix.LOOP_CTL_ADD, ^uintptr(0))
	if errno != 0 {
		return 0, nil, fmt.Errorf("LOOP_CTL_ADD: %w", errno)
	}
	n = int(ret)
	loopClaims.Lock()
	defer loopClaims.Unlock()
	if _, claimed := loopClaims.held[n]; claimed {
		return 0, nil, fmt.Errorf("new loop device %d: taken by another attach: %w", n, unix.EBUSY)
	}
	loopClaims.held[n] = struct{}{}
	return n, release, nil
}

func (l *Listener) configureLoop(name string, backing *os.File, path string, readOnly bool) error {
	lf, err := l.roots.openLoop(name)
	if err != nil {
		return err
	}
	defer lf.Close()
	var info unix.LoopInfo64
	copy(info.File_name[:len(info.File_name)-1], loopMarker+path)
	if readOnly {
		info.Flags |= loFlagsReadOnly
	}
	if !loopConfigureMissing.Load() && !l.noLoopConfigure {
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd()), Info: info}
		err := unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("LOOP_CONFIGURE %s: %w", name, err)
		}
		loopConfigureMissing.Store(true)
	}
	if err := unix.IoctlSetInt(int(lf.Fd()), unix.LOOP_SET_FD, int(backing.Fd())); err != nil {
		return fmt.Errorf("LOOP_SET_FD %s: %w", name, err)
	}
	info.Flags &^= loFlagsReadOnly // set by LOOP_SET_FD from the file's open mode
	if err := unix.IoctlLoopSetStatus64(int(lf.Fd()), &info); err != nil {
		_ = unix.IoctlSetInt(int(lf.Fd()), unix.LOOP_CLR_FD, 0)
		return fmt.Errorf("LOOP_SET_STATUS64 %s: %w", name, err)
	}
	return nil
}

// openLoop opens /dev/<name> for reading and writing.
func (r Roots) openLoop(name string) (*os.File, error) { return r.openLoopFlags(name, os.O_RDWR) }

// openLoopFlags opens /dev/<name>. Where /dev is not devtmpfs (some
// containers), a missing node is created from the number sysfs reports.
func (r Roots) openLoopFlags(name string, flags int) (*os.File, error) {
	path := filepath.Join(r.dev(), name)
	f, err := os.OpenFile(path, flags|unix.O_CLOEXEC, 0)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return f, err
	}
	s, rerr := readAttr(r.block(name), "dev")
	if rerr != nil {
		return nil, err
	}
	maj, min, rerr := parseMajorMinor(s)
	if rerr != nil {
		return nil, err
	}
	if merr := unix.Mknod(path, unix.S_IFBLK|0o660, int(unix.Mkdev(maj, min))); merr != nil && !errors.Is(merr, unix.EEXIST) {
		return nil, fmt.Errorf("create %s: %w", path, merr)
	}
	return os.OpenFile(path, flags|unix.O_CLOEXEC, 0)
}

// attachLocks serialises the attach of one backing file without a global
// lock; waiting for a file respects the context.
var attachLocks kmutex.KeyedMutex
