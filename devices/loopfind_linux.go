package devices

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs"
)

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
	var found *Device
	var others []string
	for _, name := range names {
		sysPath := r.block(name)
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
	if r.Sys == (sysfs.Root{}) && r.Dev == "" && size >= 512 {
		if names, err := readPartitionLoops(partitionsFile); err == nil {
			return names, nil
		}
	}
	all, err := r.Sys.List("class", "block")
	if err != nil {
		return nil, fmt.Errorf("list block devices: %w", err)
	}
	var names []string
	for _, name := range all {
		if nameMayBeKind(name, KindLoop) && loopBound(r.block(name)) {
			names = append(names, name)
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
