package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/berth-csi/berth/internal/errdefs"
)

// fsMark is what berth remembers of the filesystem of a volume it staged,
// beyond the volume's record, which goes at unstage: the filesystem's
// type and UUID, and whether berth made it. A later stage of the volume
// that finds the device blank, or holding a filesystem with another
// UUID, is refused instead of formatted or mounted as the volume (see
// checkMark). A mark is kept until the operator removes it: nothing on
// the node says that a volume was deleted, and a volume ID is only
// reused when the CO deletes a volume and creates one with the same ID.
type fsMark struct {
	// Version is the state format (stateVersion); marks of format 1
	// have none.
	Version  int    `json:"version,omitempty"`
	VolumeID string `json:"volumeID"`
	FsType   string `json:"fsType"`
	UUID     string `json:"uuid"`
	// Made is set when berth ran mkfs, clear when it found the
	// filesystem there at the volume's first stage.
	Made bool `json:"made"`
}

// fsMarks keeps one fsMark per volume ID in dir, named like the volume's
// record (stateFileName) and written as durably. Its callers hold the
// volume's lock.
type fsMarks struct{ dir string }

func openFSMarks(dir string) (*fsMarks, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create filesystem marks directory: %w", err)
	}
	return &fsMarks{dir: dir}, nil
}

// path is the file of volume id's mark, for the operator's messages.
func (m *fsMarks) path(id string) string { return filepath.Join(m.dir, stateFileName(id)) }

// get returns the mark of volume id; nil, nil when it has none. A mark
// that cannot be read is an error: a stage that went on without it
// might format the volume.
func (m *fsMarks) get(id string) (*fsMark, error) {
	b, err := os.ReadFile(m.path(id))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("volume %q: read its filesystem mark: %w", id, err)
	}
	version, err := formatVersion(m.path(id), b)
	if newer := (*newerFormatError)(nil); errors.As(err, &newer) {
		return nil, m.newer(id, newer)
	}
	var mk fsMark
	if err == nil {
		err = json.Unmarshal(b, &mk)
	}
	if err != nil || mk.VolumeID != id {
		return nil, fmt.Errorf("volume %q: filesystem mark %s cannot be read (%v); berth does not stage the volume without it: check the volume, then remove the file", id, m.path(id), err)
	}
	mk.Version = version
	return &mk, nil
}

// newer is the refusal of a call that finds volume id's mark in a newer
// format.
func (m *fsMarks) newer(id string, err *newerFormatError) error {
	return errdefs.FailedPrecondition("volume %q: its filesystem mark %v; berth changes nothing of the volume: run a berth that reads format %d for it, or the one that wrote it", id, err, err.version)
}

// put writes a mark durably, in today's format.
func (m *fsMarks) put(mk *fsMark) error {
	mk.Version = stateVersion
	b, err := json.Marshal(mk)
	if err != nil {
		return fmt.Errorf("encode filesystem mark of volume %q: %w", mk.VolumeID, err)
	}
	if err := writeFileAtomic(m.dir, stateFileName(mk.VolumeID), b); err != nil {
		return fmt.Errorf("save filesystem mark of volume %q: %w", mk.VolumeID, err)
	}
	return nil
}

// remove deletes the mark of volume id; a missing mark is not an error,
// and one in a newer format is refused.
func (m *fsMarks) remove(id string) error {
	if b, err := os.ReadFile(m.path(id)); err == nil {
		if _, err := formatVersion(m.path(id), b); err != nil {
			if newer := (*newerFormatError)(nil); errors.As(err, &newer) {
				return m.newer(id, newer)
			}
		}
	}
	err := os.Remove(m.path(id))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove filesystem mark of volume %q: %w", id, err)
	}
	if err := syncDir(m.dir); err != nil {
		return fmt.Errorf("remove filesystem mark of volume %q: %w", id, err)
	}
	return nil
}

// describe names the filesystem of a mark for messages.
func (mk *fsMark) describe() string {
	how := "found"
	if mk.Made {
		how = "made"
	}
	return fmt.Sprintf("the %s filesystem with UUID %s that berth %s on it at its first stage", mk.FsType, mk.UUID, how)
}

// filesystemGone is the refusal of a stage that finds blank the device of
// a volume whose filesystem berth staged before.
func (m *fsMarks) filesystemGone(mk *fsMark, devPath string) error {
	return errdefs.FailedPrecondition("volume %q: its device %s reads blank: %s is gone (an image file replaced, a LUN or namespace that lost its data, or other storage behind the volume's name or number); berth never formats a volume it staged with a filesystem again: check the storage; if the volume was deleted and created anew under the same ID, remove %s and stage again",
		mk.VolumeID, devPath, mk.describe(), m.path(mk.VolumeID))
}

// otherFilesystem is the refusal of a stage that finds, on the device of
// a volume whose filesystem berth staged before, one with another UUID.
func (m *fsMarks) otherFilesystem(mk *fsMark, devPath, fsType, uuid string) error {
	return errdefs.FailedPrecondition("volume %q: its device %s holds a filesystem of type %s with UUID %s, not %s: this is not the volume's filesystem (other storage behind the volume's name or number, or a filesystem made again outside berth); berth does not mount it as the volume: check the storage; if the change is intended, remove %s and stage again",
		mk.VolumeID, devPath, fsType, uuid, mk.describe(), m.path(mk.VolumeID))
}
