package devices

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/kmutex"
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

// FindLoop returns the loop device that shows exactly file: bound to the
// same inode (any name of it, hard links included), from offset 0, without
// a size limit. Loop devices of the file at an offset or with a size limit
// (an operator's losetup -o) are not it; without one that is, the error
// wraps errdefs.ErrNotFound.
func (r Roots) FindLoop(file string) (*Device, error) {
	path := canonicalFile(file)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("loop device backed by %s: %w", path, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("loop device backed by %s: %w", path, err)
	}
	return r.findLoopFile(path, fileID{dev: st.Dev, ino: st.Ino, size: st.Size}, false)
}

// FindLoopOf is FindLoop for a file the caller opened (by a name it
// resolved without following symbolic links): the loop device bound to
// the inode f holds, whatever its name leads to now.
func (r Roots) FindLoopOf(f *os.File) (*Device, error) {
	id, err := fileIDOf(f)
	if err != nil {
		return nil, fmt.Errorf("loop device backed by %s: %w", f.Name(), err)
	}
	return r.findLoopFile(f.Name(), id, false)
}

// FindDeletedLoop returns the loop device berth attached to the file path
// that has been deleted since: the kernel then reports its backing file as
// "<path> (deleted)". Its inode cannot be compared any more, so only a
// device with berth's marker (see loopMarker), offset 0 and no size limit
// is returned. path is taken as it is.
func (r Roots) FindDeletedLoop(path string) (*Device, error) {
	backing := path + " (deleted)"
	var found *Device
	err := r.scanBlock(KindLoop, loopMatcher{file: backing}, func(d *Device) bool {
		if d.ID.Kind != KindLoop || d.ID.BackingFile != backing {
			return false
		}
		info, err := loopStatus(d)
		if err != nil || loopDiff(info) != "" || !strings.HasPrefix(cString(info.File_name[:]), loopMarker) {
			return false
		}
		d.backingDev, d.backingIno = info.Device, info.Inode
		found = d
		return true
	})
	if err != nil {
		return nil, err
	}
	if found == nil {
		return nil, fmt.Errorf("loop device attached by berth to deleted %s: %w", path, errdefs.ErrNotFound)
	}
	return found, nil
}

// MarkedLoop is a bound loop device that carries berth's marker (see
// loopMarker): berth attached it.
type MarkedLoop struct {
	Device *Device
	// File is the path berth attached the image by (lo_file_name after
	// the marker); the kernel's view of the file is Device.ID.BackingFile.
	File string
}

// MarkedLoops returns every bound loop device that carries berth's
// marker, for diagnostics. It only reads: sysfs, and LOOP_GET_STATUS64
// through each device's node opened read-only. A device whose node is
// missing from /dev is skipped (its node is never created), and so is
// one unbound or rebound while it was looked at. A returned device has
// its backing file's numbers (see Device.LoopRef).
func (r Roots) MarkedLoops() ([]MarkedLoop, error) {
	names, err := r.boundLoops(512)
	if err != nil {
		return nil, err
	}
	var out []MarkedLoop
	for _, name := range names {
		d, err := r.readDevice(r.block(name), KindLoop)
		if err != nil || d.ID.Kind != KindLoop || d.ID.BackingFile == "" {
			continue
		}
		info, err := loopStatusNoCreate(d)
		if err != nil {
			continue
		}
		file, ok := strings.CutPrefix(cString(info.File_name[:]), loopMarker)
		if !ok {
			continue
		}
		d.backingDev, d.backingIno = info.Device, info.Inode
		out = append(out, MarkedLoop{Device: d, File: file})
	}
	return out, nil
}

// loopStatusNoCreate is loopStatus for a caller that must change
// nothing: a missing node is an error, not created.
func loopStatusNoCreate(d *Device) (*unix.LoopInfo64, error) {
	f, err := os.OpenFile(d.Path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := checkLoopNode(f, d); err != nil {
		return nil, err
	}
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return nil, fmt.Errorf("LOOP_GET_STATUS64 %s: %w", d.Path, err)
	}
	return info, nil
}

// FindLoopRef returns the loop device ref names if it is still that
// attach: the device of that name has that number (and disk sequence
// number, when ref has one) and is bound to the file ref names, from
// offset 0 without a size limit. The file is compared by its device and
// inode numbers, never by a name: the name it had may since be another
// file's, or a symbolic link to one. Anything else (the device gone,
// unbound, bound to another file) is an error wrapping
// errdefs.ErrNotFound.
func (r Roots) FindLoopRef(ref LoopRef) (*Device, error) {
	if err := checkName(ref.Name); err != nil || !nameMayBeKind(ref.Name, KindLoop) || ref.BackingIno == 0 {
		return nil, fmt.Errorf("find loop device %v: not a loop device reference: %w", ref, errdefs.ErrInvalidArgument)
	}
	gone := func(why string) (*Device, error) {
		return nil, fmt.Errorf("loop device %v: %s: %w", ref, why, errdefs.ErrNotFound)
	}
	d, err := r.readDevice(r.block(ref.Name), KindLoop)
	if errors.Is(err, errdefs.ErrNotFound) {
		return gone("no such device")
	} else if err != nil {
		return nil, fmt.Errorf("find loop device %v: %w", ref, err)
	}
	switch {
	case d.ID.Kind != KindLoop || d.Major != ref.Major || d.Minor != ref.Minor:
		return gone(fmt.Sprintf("the name is device %d:%d now", d.Major, d.Minor))
	case d.ID.BackingFile == "":
		return gone("not bound")
	case ref.DiskSeq != 0 && d.DiskSeq != 0 && d.DiskSeq != ref.DiskSeq:
		return gone(fmt.Sprintf("bound again since (disk sequence number %d)", d.DiskSeq))
	}
	info, err := loopStatus(d)
	switch {
	case errors.Is(err, errdefs.ErrNotFound), errors.Is(err, unix.ENXIO), errors.Is(err, fs.ErrNotExist):
		return gone("not bound")
	case err != nil:
		return nil, fmt.Errorf("find loop device %v: %w", ref, err)
	case info.Device != ref.BackingDev || info.Inode != ref.BackingIno:
		return gone(fmt.Sprintf("bound to file %d:%d (%s) now", info.Device, info.Inode, d.ID.BackingFile))
	case loopDiff(info) != "":
		return gone("bound with " + loopDiff(info))
	}
	d.backingDev, d.backingIno = info.Device, info.Inode
	return d, nil
}

// fileID is the identity of a file: the device and inode numbers stat
// reports (and LOOP_GET_STATUS64 as lo_device, lo_inode). size is the
// file's size when it was looked at, which is not part of its identity.
type fileID struct {
	dev, ino uint64
	size     int64
}

func (id fileID) String() string { return fmt.Sprintf("file %d:%d", id.dev, id.ino) }

func fileIDOf(f *os.File) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fileID{}, fmt.Errorf("fstat: %w", err)
	}
	return fileID{dev: st.Dev, ino: st.Ino, size: st.Size}, nil
}

// findLoopFile returns the loop device bound to the file id (path only
// names it in errors) from offset 0 without a size limit. With strict,
// any other loop device of the file (an offset, a size limit) is an
// error wrapping errdefs.ErrFailedPrecondition that names it and what
// differs: it shows some of the same bytes, and writing through both
// corrupts what either holds. Without strict such devices are passed
// over.
//
// Each bound loop device (see boundLoops) is asked for its backing inode
// (LOOP_GET_STATUS64); only the devices of the file are read from sysfs
// in full. This runs for every attach, detach and health check of a file
// volume.
func (r Roots) findLoopFile(path string, id fileID, strict bool) (*Device, error) {
	names, err := r.boundLoops(id.size)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(r.sys(), "class", "block")
	var found *Device
	var others []string
	for _, name := range names {
		sysPath := filepath.Join(dir, name)
		info, dev, err := r.loopStatusByName(name)
		if err != nil || info.Device != id.dev || info.Inode != id.ino {
			continue
		}
		// The whole device, checked to be the one whose status was read.
		d, err := r.readDevice(sysPath, KindLoop)
		if err != nil || d.ID.Kind != KindLoop || d.ID.BackingFile == "" ||
			d.Major != unix.Major(dev) || d.Minor != unix.Minor(dev) {
			continue
		}
		if diff := loopDiff(info); diff != "" {
			others = append(others, d.Path+" ("+diff+")")
			continue
		}
		if found == nil {
			d.backingDev, d.backingIno = info.Device, info.Inode
			found = d
		}
	}
	if strict && len(others) > 0 {
		return nil, fmt.Errorf("loop device for %s: %s already attached to it, showing other bytes than the whole file; berth neither adopts nor replaces it: detach it (losetup -d) or use another file: %w",
			path, strings.Join(others, ", "), errdefs.ErrFailedPrecondition)
	}
	if found == nil {
		return nil, fmt.Errorf("loop device backed by %s: %w", path, errdefs.ErrNotFound)
	}
	return found, nil
}

// partitionsFile lists the block devices that have a capacity.
var partitionsFile = "/proc/partitions"

// boundLoops returns the names of the loop devices that may be bound to
// a file of size bytes. On the node's own trees these are the loop
// devices /proc/partitions lists: the kernel lists only devices with a
// capacity, and a loop device has one while it is bound, unless its
// file was empty when it was bound or it starts at or past the file's
// end (it then shows no byte of the file). One read, where asking each
// loop device costs a lookup in sysfs per device: nodes keep hundreds of
// unbound loop devices. For a file smaller than a sector (whose loop
// device has no capacity), a list that cannot be read, and trees other
// than the node's own (tests), every loop device that has a backing file
// is returned.
func (r Roots) boundLoops(size int64) ([]string, error) {
	if r.Sys == "" && r.Dev == "" && size >= 512 {
		if names, err := readPartitionLoops(partitionsFile); err == nil {
			return names, nil
		}
	}
	dir := filepath.Join(r.sys(), "class", "block")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list block devices: %w", err)
	}
	var names []string
	for _, e := range ents {
		if nameMayBeKind(e.Name(), KindLoop) && loopBound(filepath.Join(dir, e.Name())) {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// readPartitionLoops returns the whole loop devices (loopN, not their
// partitions) that the partitions file at path lists.
func readPartitionLoops(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var names []string
	for line := range strings.Lines(string(b)) {
		// major minor #blocks name
		f := strings.Fields(line)
		if len(f) != 4 {
			continue
		}
		if n, ok := strings.CutPrefix(f[3], "loop"); ok && n != "" && strings.Trim(n, "0123456789") == "" {
			names = append(names, f[3])
		}
	}
	return names, nil
}

// loopStatusByName reads the status of the loop device /dev/<name> and
// returns it with the device number of the node it opened.
func (r Roots) loopStatusByName(name string) (*unix.LoopInfo64, uint64, error) {
	f, err := r.openLoopFlags(name, os.O_RDONLY)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, 0, fmt.Errorf("fstat /dev/%s: %w", name, err)
	}
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return nil, 0, fmt.Errorf("LOOP_GET_STATUS64 /dev/%s: %w", name, err)
	}
	return info, st.Rdev, nil
}

// loopDiff says how a loop device's view differs from its whole backing
// file, "" when it does not.
func loopDiff(info *unix.LoopInfo64) string {
	var out []string
	if info.Offset != 0 {
		out = append(out, fmt.Sprintf("offset %d", info.Offset))
	}
	if info.Sizelimit != 0 {
		out = append(out, fmt.Sprintf("size limit %d", info.Sizelimit))
	}
	if info.Encrypt_type != 0 {
		out = append(out, fmt.Sprintf("encryption type %d", info.Encrypt_type))
	}
	return strings.Join(out, ", ")
}

// openLoopChecked opens the node of the loop device d read-only and
// checks that it still has d's number; another number is an error
// wrapping errdefs.ErrNotFound.
func openLoopChecked(d *Device) (*os.File, error) {
	f, err := d.roots.openLoopFlags(d.Name, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	if err := checkLoopNode(f, d); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// checkLoopNode checks that f, an open device node, is the block device
// d; another number is an error wrapping errdefs.ErrNotFound.
func checkLoopNode(f *os.File, d *Device) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("fstat %s: %w", d.Path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(st.Rdev) != d.Major || unix.Minor(st.Rdev) != d.Minor {
		return fmt.Errorf("%s: is %d:%d, expected %d:%d: %w", d.Path, unix.Major(st.Rdev), unix.Minor(st.Rdev), d.Major, d.Minor, errdefs.ErrNotFound)
	}
	return nil
}

// loopStatus reads the status of the loop device d, checking that the
// device still has d's number once it is open.
func loopStatus(d *Device) (*unix.LoopInfo64, error) {
	f, err := openLoopChecked(d)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return nil, fmt.Errorf("LOOP_GET_STATUS64 %s: %w", d.Path, err)
	}
	return info, nil
}

// cString returns the bytes of b up to its first NUL.
func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// loopBound reports whether the loop device at sysPath has a backing
// file: the kernel adds its "loop" attribute directory when it binds one
// and removes it when it unbinds. One stat, not a read of backing_file,
// since a scan asks this of every loop device on the node.
func loopBound(sysPath string) bool {
	_, err := os.Lstat(filepath.Join(sysPath, "loop"))
	return err == nil
}

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
	size, err := blockDeviceSize(lf)
	if err != nil {
		return 0, fmt.Errorf("refresh capacity of %s: %w", dev.Path, err)
	}
	dev.Size = size
	return size, nil
}

func blockDeviceSize(f *os.File) (int64, error) {
	var size uint64
	if err := ioctlPtr(f, unix.BLKGETSIZE64, &size); err != nil {
		return 0, fmt.Errorf("BLKGETSIZE64: %w", err)
	}
	return int64(size), nil
}

// attachLocks serialises the attach of one backing file without a global
// lock; waiting for a file respects the context.
var attachLocks kmutex.KeyedMutex

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
	if err := unix.IoctlSetInt(int(lf.Fd()), unix.BLKFLSBUF, 0); err != nil {
		return nil, 0, fmt.Errorf("BLKFLSBUF %s: %w", d.Path, err)
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
	size, err := blockDeviceSize(lf)
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
