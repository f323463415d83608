package devices

import (
	"errors"
	"fmt"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Verify checks, right before the device is written to, that d.Path is still
// the block device that was found: the node has the same major:minor, sysfs
// still shows the same identity and disk sequence number. Any difference is
// an error wrapping errdefs.ErrFailedPrecondition that says what was
// expected and what was found. d.Size is refreshed.
func (d *Device) Verify() error {
	if d == nil || d.Name == "" {
		return fmt.Errorf("verify device: no device: %w", errdefs.ErrInvalidArgument)
	}
	maj, min, err := statBlockNode(d.Path)
	if err != nil {
		return fmt.Errorf("verify %s: expected block device %d:%d: %w (%w)", d.Path, d.Major, d.Minor, err, errdefs.ErrFailedPrecondition)
	}
	if maj != d.Major || min != d.Minor {
		return fmt.Errorf("verify %s: expected device %d:%d, node is %d:%d: %w", d.Path, d.Major, d.Minor, maj, min, errdefs.ErrFailedPrecondition)
	}
	if err := checkName(d.Name); err != nil {
		return fmt.Errorf("verify %s: %w", d.Path, err)
	}
	cur, err := d.roots.readDevice(d.roots.block(d.Name), "")
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("verify %s: expected %s %s, the device is gone: %w", d.Path, d.Name, describeID(d.ID), errdefs.ErrFailedPrecondition)
		}
		return fmt.Errorf("verify %s: %w", d.Path, err)
	}
	if diff := d.diff(cur); diff != "" {
		return fmt.Errorf("verify %s: identity changed: %s: %w", d.Path, diff, errdefs.ErrFailedPrecondition)
	}
	d.Size = cur.Size
	return nil
}

// diff describes how cur differs from d as "expected X, found Y" pairs.
func (d *Device) diff(cur *Device) string {
	var out []string
	add := func(what string, want, got any) {
		out = append(out, fmt.Sprintf("%s: expected %v, found %v", what, quoteIfString(want), quoteIfString(got)))
	}
	if cur.Major != d.Major || cur.Minor != d.Minor {
		add("device number", fmt.Sprintf("%d:%d", d.Major, d.Minor), fmt.Sprintf("%d:%d", cur.Major, cur.Minor))
	}
	a, b := d.ID, cur.ID
	if a.Kind != b.Kind {
		add("kind", a.Kind, b.Kind)
	}
	if a.WWID != b.WWID {
		add("WWID", a.WWID, b.WWID)
	}
	if a.HCTL != b.HCTL {
		add("SCSI address", a.HCTL, b.HCTL)
	}
	if a.NQN != b.NQN {
		add("subsystem NQN", a.NQN, b.NQN)
	}
	if a.NSID != b.NSID {
		add("namespace ID", a.NSID, b.NSID)
	}
	if a.UUID != b.UUID {
		add("namespace UUID", a.UUID, b.UUID)
	}
	if a.NGUID != b.NGUID {
		add("namespace NGUID", a.NGUID, b.NGUID)
	}
	if a.BackingFile != b.BackingFile {
		add("backing file", a.BackingFile, b.BackingFile)
	}
	if a.DMName != b.DMName {
		add("map name", a.DMName, b.DMName)
	}
	if d.DiskSeq != 0 && cur.DiskSeq != 0 && d.DiskSeq != cur.DiskSeq {
		add("disk sequence number (the medium was replaced)", d.DiskSeq, cur.DiskSeq)
	}
	return strings.Join(out, "; ")
}

func quoteIfString(v any) any {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return v
}

func describeID(id Identity) string {
	switch id.Kind {
	case KindLoop:
		return "backed by " + id.BackingFile
	case KindSCSI:
		return fmt.Sprintf("at %s with WWID %s", id.HCTL, id.WWID)
	case KindNVMe:
		return fmt.Sprintf("namespace %d of %s", id.NSID, id.NQN)
	case KindDM:
		return fmt.Sprintf("map %s (%s)", id.DMName, id.WWID)
	}
	return ""
}
