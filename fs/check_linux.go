package fs

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Fsck checks the filesystem on devPath before it is mounted; see the
// package documentation for the policy. ext4 is preened with `e2fsck -p`
// unless it is mounted somewhere; xfs is never checked here.
func Fsck(ctx context.Context, devPath, fsType string) error {
	if err := checkFsType(fsType); err != nil {
		return err
	}
	if fsType == XFS {
		// XFS recovers by replaying its log at mount time; see the
		// package documentation.
		return nil
	}
	if _, err := statBlockDevice(devPath); err != nil {
		return err
	}
	inUse, err := deviceInUse(devPath)
	if err != nil {
		return fmt.Errorf("fsck %s: %w", devPath, err)
	}
	if inUse {
		// Already mounted (a staging mount left by an earlier attempt)
		// or held: checking a mounted filesystem is unsafe and
		// pointless.
		return nil
	}
	release, err := acquireHeavy(ctx, "fsck "+devPath)
	if err != nil {
		return err
	}
	defer release()
	_, err = runTool(ctx, "e2fsck", "-p", "--", devPath)
	return fsckResult(devPath, err)
}

// deviceInUse reports whether a block device is mounted or otherwise held
// exclusively (a device-mapper table, a running mkfs): the kernel refuses
// an O_EXCL open of a block device with EBUSY then. No mount table is
// read, so the answer costs the same on a node with ten thousand mounts.
// A device whose open waits stalls only this call (blockdev.Held).
func deviceInUse(devPath string) (bool, error) {
	return blockdev.Held(devPath)
}

// Resize grows the filesystem on devPath to fill the device. ext4 is
// grown with resize2fs on the device: online when mounted, else after the
// full `e2fsck -f -p` check resize2fs requires. xfs grows only online,
// with xfs_growfs on mountPath. When mountPath is given it must be the
// mount point of devPath. Growing a filesystem that already fills the
// device succeeds and changes nothing.
func Resize(ctx context.Context, devPath, mountPath, fsType string) error {
	if err := checkFsType(fsType); err != nil {
		return err
	}
	rdev, err := statBlockDevice(devPath)
	if err != nil {
		return err
	}
	if mountPath == "" && fsType == XFS {
		return fmt.Errorf("resize %s: xfs grows only while mounted and no mount path was given: %w", devPath, errdefs.ErrInvalidArgument)
	}
	if mountPath != "" {
		st, err := StatPath(mountPath)
		if err != nil {
			return fmt.Errorf("resize %s: %w", devPath, err)
		}
		if !st.MountRoot {
			return fmt.Errorf("resize %s: nothing is mounted at %s: %w", devPath, mountPath, errdefs.ErrNotFound)
		}
		if st.FSError != nil {
			return fmt.Errorf("resize %s: the filesystem at %s fails (%w): %w", devPath, mountPath, st.FSError, errdefs.ErrFailedPrecondition)
		}
		if st.Major != unix.Major(rdev) || st.Minor != unix.Minor(rdev) {
			return fmt.Errorf("resize %s: %s is a mount of device %d:%d, not of this device (%d:%d): %w",
				devPath, mountPath, st.Major, st.Minor, unix.Major(rdev), unix.Minor(rdev), errdefs.ErrFailedPrecondition)
		}
		if st.FSType != fsType {
			return fmt.Errorf("resize %s: %s is mounted as %s, not %s: %w", devPath, mountPath, st.FSType, fsType, errdefs.ErrFailedPrecondition)
		}
	}
	release, err := acquireHeavy(ctx, "resize "+devPath)
	if err != nil {
		return err
	}
	defer release()
	switch fsType {
	case Ext4:
		if mountPath == "" {
			inUse, err := deviceInUse(devPath)
			if err != nil {
				return fmt.Errorf("resize %s: %w", devPath, err)
			}
			if !inUse {
				// Offline, resize2fs insists on a fresh full check.
				_, err := runTool(ctx, "e2fsck", "-f", "-p", "--", devPath)
				if err := fsckResult(devPath, err); err != nil {
					return fmt.Errorf("resize %s: %w", devPath, err)
				}
			}
		}
		_, err = runTool(ctx, "resize2fs", "--", devPath)
		var te *command.Error
		if errors.As(err, &te) && strings.Contains(te.Output, "Permission denied to resize") {
			// EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE. A missing
			// capability stays missing until berth is restarted with it:
			// FailedPrecondition, not Unavailable, which COs retry
			// forever.
			te.Kind = errdefs.ErrFailedPrecondition
			return fmt.Errorf("resize %s: the kernel refused the online ext4 resize: berth runs without CAP_SYS_RESOURCE; "+
				"give it the capability (berth.service's CapabilityBoundingSet has it; in Kubernetes privileged: true or capabilities add SYS_RESOURCE) "+
				"and restart it, `berth doctor` checks it: %w", devPath, err)
		}
	case XFS:
		_, err = runTool(ctx, "xfs_growfs", "-d", "--", mountPath)
	}
	if err != nil {
		return fmt.Errorf("resize %s: %w", devPath, err)
	}
	return nil
}
