package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	berthfs "github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// prepareFilesystem makes the volume's filesystem on a blank device (or a
// new LUKS mapping) or checks the one that is there.
//
// A volume whose filesystem berth staged before (its fsMark) is never
// formatted again: a device found blank is refused, and so is one that
// holds a filesystem with another UUID than the one berth staged.
func (n *nodeServer) prepareFilesystem(ctx context.Context, s *stageRun) error {
	rec, vcap, vdev := s.rec, s.vcap, s.vdev
	mark, err := n.a.marks.get(s.id)
	if err != nil {
		return err
	}
	var formatted bool
	if s.freshFS {
		// A new LUKS device: its mapping reads as noise, which no
		// probe calls blank; the blank underlying device was the
		// proof, and the record says the format is berth's.
		if err := n.a.host.Format(ctx, vdev.Path, vcap.FsType, s.mkfs); err != nil {
			return err
		}
		rec.Crypt.Formatting = nil
		if err := n.a.state.put(rec); err != nil {
			return err
		}
		formatted = true
	} else {
		if formatted, err = n.ensureFilesystem(ctx, rec, vdev, vcap.FsType, s.mkfs, mark, s.took); err != nil {
			switch {
			case errors.Is(err, berthfs.ErrLUKSDevice) && s.enc == nil:
				err = fmt.Errorf("volume %q: %w; it is staged only as an encrypted volume: volume_context %s=\"true\" and its passphrase in node_stage_secrets %q",
					s.id, err, ContextEncrypted, SecretEncryptionPassphrase)
			case errors.Is(err, errdefs.ErrFailedPrecondition):
				// The device's name (/dev/loopN, /dev/sdX) is gone once
				// the failed stage detached it: name what the operator
				// can look at, and wipe if it must.
				err = fmt.Errorf("volume %q (%s %s): %w", s.id, s.tr.Name(), s.target.Key(), err)
			}
			return err
		}
	}
	uuid, err := n.a.host.FilesystemUUID(vdev.Path, vcap.FsType)
	if err != nil {
		return fmt.Errorf("volume %q: %w", s.id, err)
	}
	if formatted {
		s.madeFS = true
		// Before the mount: a filesystem given to a pod is marked.
		if err := n.a.marks.put(&fsMark{VolumeID: s.id, FsType: vcap.FsType, UUID: uuid, Made: true}); err != nil {
			return err
		}
		s.took.mark("format")
		s.log.InfoContext(ctx, "created filesystem", slog.String("fs_type", vcap.FsType), slog.String("fs_uuid", uuid))
	} else {
		s.took.mark("probe")
		switch {
		case mark == nil:
			// Staged by berth for the first time, or by a berth
			// that kept no marks.
			if err := n.a.marks.put(&fsMark{VolumeID: s.id, FsType: vcap.FsType, UUID: uuid}); err != nil {
				return err
			}
		case mark.FsType != vcap.FsType || mark.UUID != uuid:
			return n.a.marks.otherFilesystem(mark, vdev.Path, vcap.FsType, uuid)
		}
		if !s.mkfs.IsZero() {
			s.log.InfoContext(ctx, "the volume already has a filesystem: it is mounted as it is, without the mkfs parameters of its volume_context",
				slog.String("fs_type", vcap.FsType))
		}
		// A read-only device (a snapshot the array exports read-only)
		// of a reader-only volume is mounted without a check: e2fsck
		// cannot open it for writing, and the volume is never written.
		if vcap.readOnly() {
			if ro, err := n.a.host.DeviceReadOnly(vdev.Path); err == nil && ro {
				s.log.InfoContext(ctx, "read-only device of a reader-only volume: not checked with fsck", slog.String("fs_type", vcap.FsType))
				return nil
			}
		}
		// The filesystem is on vdev: an encrypted volume's mapping, whose
		// LUKS device under it is held and so never checked.
		if err := n.a.host.Fsck(ctx, vdev.Path, vcap.FsType); err != nil {
			return err
		}
		s.took.mark("fsck")
	}
	return nil
}

// mountFilesystem mounts the volume's filesystem at the staging path,
// once the device name is checked again, and checks the mount it made.
func (n *nodeServer) mountFilesystem(s *stageRun) error {
	rec, vcap, vdev := s.rec, s.vcap, s.vdev
	// mkfs and fsck take time; make sure the name still means the
	// device we checked before mounting it.
	if err := n.a.verify(vdev); err != nil {
		return err
	}
	s.took.mark("verify_again")
	flags, data, err := n.mountOptions(vcap, vcap.readOnly())
	if err != nil {
		return err
	}
	data = xfsNoUUID(vcap.FsType, data)
	err = n.a.host.Mount(vdev.Path, s.sh, vcap.FsType, flags, data)
	if err != nil && vcap.readOnly() && errors.Is(err, berthfs.ErrRecoveryNeedsWrite) {
		// A journal that needs replaying on a device that cannot be
		// written (a snapshot taken while its filesystem was in use):
		// a reader-only volume is mounted as the journal left it,
		// without the transactions it holds. Never for a writable mount.
		opt := noRecovery(vcap.FsType)
		s.log.Warn("the filesystem's journal needs recovery, which a read-only device does not allow: mounting the reader-only volume with "+opt+" (without the journal's last transactions)",
			slog.String("fs_type", vcap.FsType), slog.String("error", err.Error()))
		err = n.a.host.Mount(vdev.Path, s.sh, vcap.FsType, flags, joinOptions(data, opt))
	}
	if err != nil {
		return err
	}
	s.mounted = true
	s.took.mark("mount")
	root, err := n.a.mountAt(s.sp)
	if err != nil {
		return fmt.Errorf("staging_target_path %q: check the new mount: %w", s.staging, err)
	}
	if !sameDevice(root, rec.volumeDevice()) {
		return fmt.Errorf("staging_target_path %q: after mounting %s it shows device %d:%d", s.staging, vdev.Path, root.Major, root.Minor)
	}
	// The inode of the filesystem's root: later checks tell the
	// volume's root from a directory inside it by it.
	rec.StagingRootIno = root.Ino
	return nil
}

// xfsNoUUID adds nouuid to the mount data of an xfs filesystem. xfs
// refuses to mount a second filesystem with a UUID already mounted, which
// is what a clone or a restored snapshot of a staged volume has. Its
// purpose, never mounting the same storage twice, berth serves by
// identity instead: one storage object stages as one volume only, and a
// device is checked against every staged one.
// noRecovery is the mount option that mounts fsType without replaying
// its journal.
func noRecovery(fsType string) string {
	if fsType == berthfs.XFS {
		return "norecovery"
	}
	return "noload"
}

// joinOptions appends a mount option to mount data.
func joinOptions(data, opt string) string {
	if data == "" {
		return opt
	}
	return data + "," + opt
}

func xfsNoUUID(fsType, data string) string {
	if fsType != "xfs" || slices.Contains(strings.Split(data, ","), "nouuid") {
		return data
	}
	if data == "" {
		return "nouuid"
	}
	return data + ",nouuid"
}
