package agent

import (
	"errors"
	"fmt"

	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/forklock"
)

// The checks below decide whether a path shows the volume, from what the
// kernel reports for the path itself: the device of the filesystem
// mounted there, the inode at the path and the device a device node
// stands for. "Something is mounted there" is not enough: a staging
// mount lost behind berth's back leaves a directory of the node's root
// filesystem, and a bind of it would take a pod's writes.

// sameDevice reports whether a mount is of the recorded device.
func sameDevice(m mountEntry, d *deviceRecord) bool {
	return d != nil && uint32(m.Major) == d.Major && uint32(m.Minor) == d.Minor
}

// isVolumeRoot reports whether m is the root of the volume's filesystem:
// the recorded device and, when it was recorded, the inode the staging
// mount showed at stage (a bind of a directory inside the volume has the
// same device but another inode).
func isVolumeRoot(m mountEntry, rec *volumeRecord) bool {
	return sameDevice(m, rec.volumeDevice()) && (rec.StagingRootIno == 0 || m.Ino == rec.StagingRootIno)
}

// checkStagingMount checks that the staging path of a staged mount volume
// is the root of a mount of the volume's device with the recorded
// filesystem type. A lost or foreign mount is FAILED_PRECONDITION: the CO
// calls NodeStageVolume again, which mounts it back. Its descriptor of
// the mount reaches no child started meanwhile (see forklock): an unstage
// may follow.
func (a *Agent) checkStagingMount(rec *volumeRecord) error {
	defer forklock.Hold()()
	h, err := a.openStagingMount(rec)
	if err != nil {
		return err
	}
	return h.Close()
}

// checkStagingEntry is checkStagingMount for an entry already read.
func checkStagingEntry(rec *volumeRecord, m mountEntry) error {
	staging, d := rec.StagingPath, rec.volumeDevice()
	switch {
	case d == nil:
		return errdefs.FailedPrecondition("volume %q: staging path %q holds a mount of device %d:%d (%s), and no device is recorded for the volume (its stage did not finish)",
			rec.VolumeID, staging, m.Major, m.Minor, m.FSType)
	case !sameDevice(m, d):
		return errdefs.FailedPrecondition("volume %q: staging path %q holds a mount of device %d:%d (%s), not of the volume's device %s (%d:%d)",
			rec.VolumeID, staging, m.Major, m.Minor, m.FSType, d.Path, d.Major, d.Minor)
	case !isVolumeRoot(m, rec):
		return errdefs.FailedPrecondition("volume %q: staging path %q shows a directory inside the volume's filesystem (inode %d), not its root (inode %d)",
			rec.VolumeID, staging, m.Ino, rec.StagingRootIno)
	case m.FSType != rec.FsType:
		return errdefs.FailedPrecondition("volume %q: staging path %q is mounted as %s, the volume was staged as %s", rec.VolumeID, staging, m.FSType, rec.FsType)
	}
	return nil
}

// checkUsable refuses a mount of the volume whose filesystem fails
// getattr: shut down after I/O errors, it stays mounted but answers
// nothing. It is still the volume's, and unpublishing and unstaging it
// (which look only at its identity) is what is left to do.
func checkUsable(rec *volumeRecord, p string, m mountEntry) error {
	if m.FSError == nil {
		return nil
	}
	return errdefs.FailedPrecondition("volume %q: the filesystem mounted at %q fails (%v): it shut down after I/O errors or the loss of its device (the kernel log says which); NodeUnpublishVolume and NodeUnstageVolume, check the device, then stage it again", rec.VolumeID, p, m.FSError)
}

// checkPublished checks that a publish target shows the volume: for a
// mount volume the root of its filesystem (one that works), for a raw
// block volume a bind of its device node. nil, false means nothing is
// mounted there. The target is opened without following symlinks, and
// its descriptor reaches no child started meanwhile: the unpublish that
// may follow unmounts it.
func (a *Agent) checkPublished(rec *volumeRecord, target string) (mounted bool, err error) {
	defer forklock.Hold()()
	h, err := fs.OpenPath(target)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("volume %q: check target_path %q: %w", rec.VolumeID, target, err)
	}
	defer h.Close()
	m, err := a.host.MountInfo(h)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("volume %q: check target_path %q: %w", rec.VolumeID, target, err)
	}
	if err := checkPublishedEntry(rec, target, m); err != nil {
		return true, err
	}
	return true, checkUsable(rec, target, m)
}

// checkPublishedEntry is checkPublished for an entry already read.
func checkPublishedEntry(rec *volumeRecord, target string, m mountEntry) error {
	d := rec.volumeDevice()
	if rec.AccessType == "block" {
		if d == nil || uint32(m.RdevMajor) != d.Major || uint32(m.RdevMinor) != d.Minor {
			return errdefs.FailedPrecondition("volume %q: target_path %q holds a mount that is not the volume's device node %s; unmount it (NodeUnpublishVolume does) and publish again", rec.VolumeID, target, d.pathOrNone())
		}
		return nil
	}
	if !isVolumeRoot(m, rec) {
		return errdefs.FailedPrecondition("volume %q: target_path %q holds a mount of device %d:%d inode %d, not the volume's filesystem (%s); unmount it (NodeUnpublishVolume does) and publish again",
			rec.VolumeID, target, m.Major, m.Minor, m.Ino, d.pathOrNone())
	}
	return nil
}

func (d *deviceRecord) pathOrNone() string {
	if d == nil {
		return "none recorded"
	}
	return d.Path
}
