// Package file is berth's file transport: a volume is an image file below
// a root directory (berth serve --file-root), attached as a loop device.
// It exists for tests, demos and single-node setups; it is also the
// transport that exercises the whole CSI lifecycle on a host without
// storage targets.
//
// volume_context "file" (KeyFile) names the image, relative to the root or
// as an absolute path below it; it also selects this transport when
// volume_context has no "transport". The name is checked lexically (no
// "..", no escape from the root) when it is parsed, and what it resolves
// to when the image is attached: a regular file reached without symbolic
// links.
//
// A volume's key is the image's clean absolute path; its identity is the
// device and inode numbers of the image, which every hard link to it
// shares, so that two names of one image are known to be one volume.
package file

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Name is the transport's name: volume_context "transport" selects it by
// this value.
const Name = "file"

// KeyFile is the volume_context key that names the image file.
const KeyFile = "file"

// Linux's limits on a file name and on a path (with its NUL).
const (
	nameMax = 255
	pathMax = 4096
)

// TransportKeys returns the volume_context keys that select the file
// transport when volume_context has no "transport".
func TransportKeys() []string { return []string{KeyFile} }

// Transport serves the volumes that are image files below its root.
type Transport struct {
	root     string
	listener *devices.Listener
}

// New returns the file transport rooted at root, which must exist; l is
// the uevent listener the loop devices' events arrive on. Symbolic links
// in root itself are resolved once here.
func New(root string, l *devices.Listener) (*Transport, error) {
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("file root %q: want an absolute path", root)
	}
	real, err := filepath.EvalSymlinks(root)
	if err != nil {
		return nil, fmt.Errorf("file root %q: %w", root, err)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return nil, fmt.Errorf("file root %q: %w", root, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("file root %q: not a directory", root)
	}
	return &Transport{root: real, listener: l}, nil
}

// Name is the transport's volume_context "transport" value.
func (t *Transport) Name() string { return Name }

// Parse checks volume_context "file" lexically only (no "..", no escape
// from the root): the file may be gone by the time a volume is unstaged.
// Attach checks what the name resolves to. The secrets are not used.
func (t *Transport) Parse(volumeContext, _ map[string]string) (*Target, error) {
	p, err := t.resolve(volumeContext[KeyFile])
	if err != nil {
		return nil, err
	}
	return &Target{t: t, path: p}, nil
}

// resolve turns the volume_context value into a clean absolute path below
// the root.
func (t *Transport) resolve(v string) (string, error) {
	switch {
	case v == "":
		return "", errdefs.InvalidArgument("volume_context[%q]: missing", KeyFile)
	case hasControl(v):
		return "", errdefs.InvalidArgument("volume_context[%q]: contains control characters", KeyFile)
	}
	for _, elem := range strings.Split(v, "/") {
		switch {
		case elem == "..":
			return "", errdefs.InvalidArgument("volume_context[%q] %q: contains \"..\"", KeyFile, v)
		case len(elem) > nameMax:
			return "", errdefs.InvalidArgument("volume_context[%q] %q: a name of %d bytes, longer than NAME_MAX (%d)", KeyFile, v, len(elem), nameMax)
		}
	}
	p := v
	if !filepath.IsAbs(p) {
		p = filepath.Join(t.root, p)
	}
	p = filepath.Clean(p)
	if !strings.HasPrefix(p, t.root+"/") {
		return "", errdefs.InvalidArgument("volume_context[%q] %q: not below the file root %s", KeyFile, v, t.root)
	}
	if len(p) >= pathMax {
		return "", errdefs.InvalidArgument("volume_context[%q] %q: the image's path is %d bytes, longer than PATH_MAX", KeyFile, v, len(p))
	}
	return p, nil
}

// Target is one image file.
type Target struct {
	t    *Transport
	path string
}

// Key is the image's clean absolute path.
func (f *Target) Key() string { return f.path }

// Identity is the device and inode numbers of the image, which every
// hard link to it shares. The path must reach the image without symbolic
// links (see check), and its last element is not followed either. An
// image that is gone gives an error wrapping errdefs.ErrNotFound.
func (f *Target) Identity() (string, error) {
	if err := f.check(); err != nil {
		return "", err
	}
	fi, err := os.Lstat(f.path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("image file %s: %w", f.path, errdefs.ErrNotFound)
		}
		return "", fmt.Errorf("image file %s: %w", f.path, err)
	}
	dev, ino, ok := fs.FileID(fi)
	if !ok || !fi.Mode().IsRegular() {
		return "", errdefs.InvalidArgument("image file %s: not a regular file", f.path)
	}
	return fmt.Sprintf("file inode %d on device %d", ino, dev), nil
}

// check makes sure the image exists, is a regular file and that the
// path reaches it without symbolic links (which could lead out of the
// root, or change what a volume is after it was staged). The path is
// opened once without following any (fs.OpenPath), so that a name being
// swapped meanwhile gives one of those answers, not an error of a
// lookup half done.
func (f *Target) check() error {
	h, err := fs.OpenPath(f.path)
	if err != nil {
		return fmt.Errorf("image file: %w", err)
	}
	defer h.Close()
	st, err := h.Stat()
	if err != nil {
		return fmt.Errorf("image file %s: %w", f.path, err)
	}
	if !st.Regular {
		return errdefs.InvalidArgument("image file %s: not a regular file", f.path)
	}
	return nil
}

// PathStates: an image has no paths.
func (f *Target) PathStates(context.Context) (map[string]int, error) { return nil, nil }

// Preflight checks that the image is there and reached without
// symbolic links.
func (f *Target) Preflight(context.Context) error { return f.check() }

// Attach attaches the image to a loop device, or returns the loop device
// that already backs it. The image is opened once, following no symbolic
// link on the way (fs.OpenPath), and what is attached is that open file
// (devices.AttachLoopFile): a name swapped for a symbolic link after the
// checks leads nowhere else, and an image renamed meanwhile is refused.
func (f *Target) Attach(ctx context.Context) (*devices.Device, error) {
	img, err := f.open(os.O_RDWR)
	if err != nil {
		return nil, fmt.Errorf("attach %w", err)
	}
	defer img.Close()
	return devices.AttachLoopFile(ctx, f.t.listener, img, f.path, false)
}

// open opens the image for I/O with flag, following no symbolic link on
// the way (fs.OpenPath): what is opened is the regular file at the name,
// or an error wrapping errdefs.ErrNotFound or errdefs.ErrInvalidArgument.
func (f *Target) open(flag int) (*os.File, error) {
	h, err := fs.OpenPath(f.path)
	if err != nil {
		return nil, fmt.Errorf("image file: %w", err)
	}
	defer h.Close()
	img, err := h.OpenFile(flag)
	if err != nil {
		return nil, fmt.Errorf("image file: %w", err)
	}
	return img, nil
}

// Detach detaches the loop device the stage attached, rec.Loop, if it is
// still bound to the file it was bound to then (devices.FindLoopRef): the
// image's name is not looked up again, so an image renamed since still
// has its device detached, and one whose name now leads to another file
// (a symbolic link put in its place) does not have that file's loop
// device detached instead. The agent does not call Detach while another
// volume uses the image (another name of it).
//
// Without rec.Loop (no device recorded) it detaches the loop device of
// the image, if any: the one that shows exactly the image
// (devices.FindLoop), never a device attached to it at an offset or with
// a size limit. An image deleted while attached is found under the name
// the kernel gives it then ("<path> (deleted)") and by berth's mark on
// the device, so its loop device does not leak. A name that no longer
// reaches a regular file without symbolic links is not followed: only
// such a deleted image's device is looked for.
func (f *Target) Detach(ctx context.Context, rec *devices.Recorded) error {
	if rec == nil || rec.Loop == nil {
		return f.detachImage(ctx)
	}
	d, err := f.t.listener.Roots().FindLoopRef(*rec.Loop)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil // detached already, or the number was given to another attach
	}
	if err != nil {
		return fmt.Errorf("image file %s: %w", f.path, err)
	}
	return f.detach(ctx, d)
}

// detachImage detaches the loop device found by the image's name.
func (f *Target) detachImage(ctx context.Context) error {
	var d *devices.Device
	img, err := f.open(os.O_RDONLY)
	if err == nil {
		d, err = f.t.listener.Roots().FindLoopOf(img)
		img.Close()
	}
	if err != nil {
		if !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrInvalidArgument) {
			return err
		}
		d, err = f.t.listener.Roots().FindDeletedLoop(f.path)
	}
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	return f.detach(ctx, d)
}

func (f *Target) detach(ctx context.Context, d *devices.Device) error {
	// udev's probe after the unmount may hold the device for a moment;
	// wait for its last close by event instead of answering busy.
	return devices.DetachLoopContext(ctx, f.t.listener, d)
}

// Expand makes the loop device take the image file's current size. The
// image is opened without following a symbolic link (see open), and the
// loop device is the one bound to that open file: a name that leads to
// another file now never has that file's loop device resized.
func (f *Target) Expand(ctx context.Context) (int64, error) {
	img, err := f.open(os.O_RDONLY)
	if errors.Is(err, errdefs.ErrNotFound) {
		return 0, fmt.Errorf("image file %s: not attached to a loop device (%v): %w", f.path, err, errdefs.ErrFailedPrecondition)
	} else if err != nil {
		return 0, fmt.Errorf("expand %w", err)
	}
	defer img.Close()
	d, err := f.t.listener.Roots().FindLoopOf(img)
	if errors.Is(err, errdefs.ErrNotFound) {
		return 0, fmt.Errorf("image file %s: not attached to a loop device: %w", f.path, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return 0, err
	}
	// LOOP_SET_CAPACITY takes whatever size the image has now, smaller
	// too: a filesystem mounted on the device would lose its end.
	fi, err := img.Stat()
	if err != nil {
		return 0, fmt.Errorf("image file %s: %w", f.path, err)
	}
	if fi.Size() < d.Size {
		return 0, fmt.Errorf("image file %s: holds %d bytes, less than its loop device %s (%d bytes); berth never shrinks a device under its data: restore the image's size: %w", f.path, fi.Size(), d.Path, d.Size, errdefs.ErrFailedPrecondition)
	}
	return devices.RefreshLoopCapacity(ctx, d)
}

// ExpandTo is Expand: an image file's size is known at once, and one
// still smaller than the CO asked for is answered OUT_OF_RANGE by
// NodeExpandVolume, which compares.
func (f *Target) ExpandTo(ctx context.Context, _ int64) (int64, error) {
	return f.Expand(ctx)
}

// StopQueueing: a loop device never queues I/O for a path to come back.
func (f *Target) StopQueueing(context.Context) (bool, error) { return false, nil }

// ResumeQueueing: StopQueueing changed nothing.
func (f *Target) ResumeQueueing(context.Context) error { return nil }

// Health reports a missing image or loop device, an image name that
// leads through a symbolic link, and an image smaller than its loop
// device.
func (f *Target) Health(context.Context) (bool, string) {
	img, err := f.open(os.O_RDONLY)
	if err != nil {
		return true, err.Error()
	}
	defer img.Close()
	d, err := f.t.listener.Roots().FindLoopOf(img)
	if err != nil {
		return true, fmt.Sprintf("image file %s: no loop device: %v", f.path, err)
	}
	if fi, err := img.Stat(); err == nil && fi.Size() < d.Size {
		return true, fmt.Sprintf("image file %s: holds %d bytes, less than its loop device %s (%d bytes): the volume's end is gone", f.path, fi.Size(), d.Path, d.Size)
	}
	return false, ""
}

// hasControl reports whether s holds a byte below 0x20 or DEL.
func hasControl(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == 0x7f {
			return true
		}
	}
	return false
}
