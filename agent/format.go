package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
)

// identifies reports whether d is the device r recorded: same numbers,
// same disk sequence (when recorded), same identity.
func (r *deviceRecord) identifies(d *devices.Device) bool {
	if d.Major != r.Major || d.Minor != r.Minor || (r.DiskSeq != 0 && d.DiskSeq != r.DiskSeq) {
		return false
	}
	return d.ID.Kind == r.Kind && d.ID.WWID == r.WWID && d.ID.NQN == r.NQN && d.ID.NSID == r.NSID &&
		d.ID.UUID == r.UUID && d.ID.NGUID == r.NGUID && d.ID.BackingFile == r.BackingFile
}

// storageChange describes how the storage behind d differs from the one
// r recorded, "" when it is the same storage: the identifiers both know
// (WWID, subsystem NQN and namespace ID, namespace UUID and NGUID, loop
// backing file) must agree. Device numbers and names may change (a
// reconnect gives a namespace a new head, a login a new disk); an
// identifier that changed means a LUN or namespace was replaced behind
// the same number.
func (r *deviceRecord) storageChange(d *devices.Device) string {
	var diff []string
	differ := func(what, was, is string) {
		if was != "" && is != "" && was != is {
			diff = append(diff, fmt.Sprintf("%s %s, was %s", what, is, was))
		}
	}
	differ("WWID", devices.NormalizeWWID(r.WWID), devices.NormalizeWWID(d.ID.WWID))
	differ("subsystem", r.NQN, d.ID.NQN)
	if r.NSID != 0 && d.ID.NSID != 0 && r.NSID != d.ID.NSID {
		diff = append(diff, fmt.Sprintf("namespace ID %d, was %d", d.ID.NSID, r.NSID))
	}
	differ("namespace UUID", r.UUID, d.ID.UUID)
	differ("namespace NGUID", r.NGUID, d.ID.NGUID)
	differ("backing file", r.BackingFile, d.ID.BackingFile)
	return strings.Join(diff, ", ")
}

// ensureFilesystem is the format step of a stage: it makes sure dev holds
// fsType. A blank device is formatted, with rec.Formatting recorded
// before mkfs starts; the mark is cleared by the write that records the
// stage (finishStage), so a stage that formats writes its record three
// times, not four. A record that says berth started formatting this very
// device (a crash during mkfs, or after it, before the stage was
// recorded) has the format made again over whatever mkfs wrote: the
// filesystem was never given to anyone, since the stage did not finish,
// and a retry that finds it mounted at the staging path (a crash after
// the mount) does not come here. Any other device holding data is
// refused. A device found blank is refused too when mark says berth
// staged a filesystem on the volume before (see fsMark).
//
// took marks the end of the probe when the device is formatted (the
// format step is then the mark's write, mkfs and its check).
func (n *nodeServer) ensureFilesystem(ctx context.Context, rec *volumeRecord, dev *devices.Device, fsType string, params fs.MkfsParams, mark *fsMark, took *stepTimer) (formatted bool, err error) {
	if rec.Formatting != nil && rec.Formatting.identifies(dev) {
		logFrom(ctx, n.a.log).WarnContext(ctx, "finishing a format that was interrupted: berth found the device blank and started mkfs before",
			slog.String("device", dev.Path), slog.String("fs_type", fsType))
		if err := n.a.host.Format(ctx, dev.Path, fsType, params); err != nil {
			return false, err
		}
		formatted = true
	} else {
		// A loop device shows an image file, whose data is read whole
		// (fs.MkfsOptions.Image).
		var image func() (*os.File, int64, error)
		if dev.ID.Kind == devices.KindLoop {
			image = func() (*os.File, int64, error) { return devices.LoopBackingFile(dev) }
		}
		formatted, err = n.a.host.EnsureFilesystem(ctx, dev.Path, fsType, params, image, func() error {
			took.mark("probe")
			if mark != nil {
				return n.a.marks.filesystemGone(mark, dev.Path)
			}
			rec.Formatting = deviceRecordOf(dev)
			return n.a.state.put(rec)
		})
		if err != nil {
			if rec.Formatting != nil && !rec.Formatting.identifies(dev) {
				err = fmt.Errorf("%w (berth started formatting this volume on device %s (%d:%d), which is not the device found now: only a format of that same device is finished)",
					err, rec.Formatting.Path, rec.Formatting.Major, rec.Formatting.Minor)
			}
			return false, err
		}
	}
	return formatted, nil
}
