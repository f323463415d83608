package agent

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"strings"

	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/forklock"
)

// heldPath is a staging or target path of a request resolved once: its
// parent directory is open (fs.OpenParent: no symbolic link on the way)
// and every later step (stat, mkdir, mount, unmount, remove) acts on the
// name inside that descriptor. Checking a path by name and then using the
// name lets a symlink swapped in between redirect the mount or unmount
// elsewhere on the host (CVE-2021-25741).
type heldPath struct {
	dir  *fs.Handle
	name string
	path string
}

// holdPath opens the parent directory of p, a path validatePath accepted.
// A missing parent is errdefs.ErrNotFound, a symbolic link on the way
// errdefs.ErrInvalidArgument.
func holdPath(field, p string) (*heldPath, error) {
	dir, name, err := fs.OpenParent(p)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, fmt.Errorf("%s %q: parent directory does not exist (the CO creates it): %w", field, p, err)
	case err != nil:
		return nil, fmt.Errorf("%s %q: %w", field, p, err)
	}
	return &heldPath{dir: dir, name: name, path: p}, nil
}

func (p *heldPath) close() {
	if p != nil {
		p.dir.Close()
	}
}

// open opens what is at the name now: the root of the mount on top if
// something is mounted there. A missing name is errdefs.ErrNotFound, a
// symlink errdefs.ErrInvalidArgument.
func (p *heldPath) open() (*fs.Handle, error) {
	return p.dir.OpenAt(p.name)
}

// mountAt describes the mount at the name; errdefs.ErrNotFound when the
// name is missing or nothing is mounted there. Its descriptor of the
// mount reaches no child started meanwhile: the copy would keep the
// mount busy for an unmount that follows (a failed stage's or publish's
// undo).
func (a *Agent) mountAt(p *heldPath) (mountEntry, error) {
	defer forklock.Hold()()
	h, err := p.open()
	if err != nil {
		return mountEntry{}, err
	}
	defer h.Close()
	return a.host.MountInfo(h)
}

// removeTarget removes a publish target berth created: an empty directory
// or a file. A missing name is fine. A target on a filesystem that is
// read-only now is left, with a warning: nothing can remove it until the
// filesystem is writable, and what was published there is gone, so
// failing would only make the CO retry for ever.
func removeTarget(ctx context.Context, log *slog.Logger, p *heldPath) error {
	err := p.dir.RemoveAt(p.name)
	switch {
	case err == nil, errors.Is(err, iofs.ErrNotExist):
		return nil
	case errors.Is(err, fs.ErrReadOnly):
		log.WarnContext(ctx, "publish target left: its filesystem is read-only", slog.String("error", err.Error()))
		return nil
	case errors.Is(err, errdefs.ErrFailedPrecondition):
		// Files below an unmounted target were written into the
		// directory itself (the mount was gone), or something is still
		// mounted there: berth does not delete data it did not create.
		return errdefs.FailedPrecondition("remove target_path %q: %v; check what is inside or mounted there", p.path, err)
	}
	return fmt.Errorf("remove target_path %q: %w", p.path, err)
}

// prepareTarget makes or opens the target of a publish: a directory for a
// mount volume, a regular file for a raw block one. An existing target
// must be of that kind, not a mount point, and empty (a directory
// without entries, a file of no bytes): a bind over it would hide what
// it holds from the node while the pod runs. Refusing is clearer.
func prepareTarget(p *heldPath, block bool) (h *fs.Handle, created bool, err error) {
	kind := "directory"
	if block {
		kind = "regular file"
		err = p.dir.CreateAt(p.name, 0o600)
	} else {
		err = p.dir.MkdirAt(p.name, 0o750)
	}
	switch {
	case err == nil:
		created = true
	case !errors.Is(err, iofs.ErrExist):
		return nil, false, fmt.Errorf("create target_path %q: %w", p.path, err)
	}
	h, err = p.open()
	if err != nil {
		if errors.Is(err, errdefs.ErrInvalidArgument) {
			return nil, created, errdefs.AlreadyExists("target_path %q: exists and is not a %s (%v)", p.path, kind, err)
		}
		return nil, created, fmt.Errorf("open target_path %q: %w", p.path, err)
	}
	defer func() {
		if err != nil {
			h.Close()
			h = nil
		}
	}()
	st, err := h.Stat()
	if err != nil {
		return nil, created, err
	}
	if created {
		return h, true, nil
	}
	switch {
	case st.MountRoot:
		return nil, false, errdefs.AlreadyExists("target_path %q: already a mount point that berth did not make", p.path)
	case block && !st.Regular:
		return nil, false, errdefs.AlreadyExists("target_path %q: exists and is not a regular file", p.path)
	case !block && !st.Dir:
		return nil, false, errdefs.AlreadyExists("target_path %q: exists and is not a directory", p.path)
	case block:
		size, err := h.Size()
		if err != nil {
			return nil, false, fmt.Errorf("target_path %q: %w", p.path, err)
		}
		if size > 0 {
			return nil, false, errdefs.FailedPrecondition("target_path %q: an existing file of %d bytes; a raw block publish there would hide its content; empty or remove it", p.path, size)
		}
	default:
		empty, err := h.Empty()
		if err != nil {
			return nil, false, fmt.Errorf("target_path %q: %w", p.path, err)
		}
		if !empty {
			return nil, false, errdefs.FailedPrecondition("target_path %q: an existing directory that is not empty; a publish there would hide its files; empty or remove it", p.path)
		}
	}
	return h, false, nil
}

// within reports whether p is dir or lies below it. Both are clean
// absolute paths (validatePath); with no symlink allowed on the way,
// names compare as the paths the kernel resolves.
func within(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, dir+"/") || dir == "/"
}

// checkTargetOutsideStaging refuses a target inside any recorded staging
// path, or one holding a staging path: the volume would be bound into
// itself or over another volume's mount. Names are compared first; the
// filesystem of the target's directory then catches a volume reached
// through a bind mount under another name.
func (a *Agent) checkTargetOutsideStaging(tp *heldPath) error {
	target := tp.path
	for _, r := range a.state.list() {
		s := r.StagingPath
		switch {
		case s == "":
		case within(target, s):
			return errdefs.InvalidArgument("target_path %q: inside the staging path %q of volume %q", target, s, r.VolumeID)
		case within(s, target):
			return errdefs.InvalidArgument("target_path %q: holds the staging path %q of volume %q", target, s, r.VolumeID)
		}
	}
	st, err := tp.dir.Stat()
	if err != nil {
		return fmt.Errorf("target_path %q: %w", target, err)
	}
	if owner, ok := a.mountOwner(mountEntry{Major: int(st.Major), Minor: int(st.Minor)}, ""); ok {
		return errdefs.InvalidArgument("target_path %q: its directory is on the filesystem of volume %q", target, owner)
	}
	return nil
}

// mountOwner returns another recorded volume whose device is that of m:
// the filesystem of a mount volume, or the device node of a raw block
// one.
func (a *Agent) mountOwner(m mountEntry, except string) (string, bool) {
	for _, r := range a.state.list() {
		if r.VolumeID == except {
			continue
		}
		for _, d := range []*deviceRecord{r.Device, r.volumeDevice()} {
			if d != nil && (sameDevice(m, d) || (uint32(m.RdevMajor) == d.Major && uint32(m.RdevMinor) == d.Minor)) {
				return r.VolumeID, true
			}
		}
	}
	return "", false
}

// openStagingMount opens the staging path of a staged mount volume (no
// symlink on the way) and checks that it is the root of a mount of the
// volume's device (checkStagingEntry) whose filesystem works
// (checkUsable). What is bound or measured later is this descriptor,
// not the name.
func (a *Agent) openStagingMount(rec *volumeRecord) (*fs.Handle, error) {
	staging := rec.StagingPath
	h, err := fs.OpenPath(staging)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, errdefs.FailedPrecondition("volume %q: its staging path %q is gone; NodeStageVolume mounts it again", rec.VolumeID, staging)
	case errors.Is(err, errdefs.ErrInvalidArgument):
		return nil, errdefs.FailedPrecondition("volume %q: staging path %q: %v", rec.VolumeID, staging, err)
	case err != nil:
		return nil, fmt.Errorf("volume %q: check staging path %q: %w", rec.VolumeID, staging, err)
	}
	m, err := a.host.MountInfo(h)
	if err == nil {
		if err = checkStagingEntry(rec, m); err == nil {
			err = checkUsable(rec, staging, m)
		}
	} else if errors.Is(err, errdefs.ErrNotFound) {
		err = errdefs.FailedPrecondition("volume %q: nothing is mounted at its staging path %q (unmounted behind berth's back?); NodeStageVolume mounts it again", rec.VolumeID, staging)
	} else {
		err = fmt.Errorf("volume %q: check staging path %q: %w", rec.VolumeID, staging, err)
	}
	if err != nil {
		h.Close()
		return nil, err
	}
	return h, nil
}
