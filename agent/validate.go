package agent

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

const (
	// maxIDLen is the CSI size limit for string fields such as volume_id.
	maxIDLen = 128
	// maxPathLen is PATH_MAX including the terminating NUL.
	maxPathLen = 4095
	// maxNameLen is NAME_MAX, the longest name of one path element.
	maxNameLen = 255
	// maxContextLen bounds one volume_context or publish_context value.
	maxContextLen = 4096
	// defaultFsType is used when a mount capability leaves fs_type empty.
	defaultFsType = "ext4"
)

// Limits on the size of a request, checked before the volume is locked
// and before any work on the request's data, so that no request holds a
// volume while berth reads through megabytes of it. The CSI spec caps a
// map at 4 KiB; drivers that copy StorageClass parameters and the CO's
// own keys (csi.storage.k8s.io/pv/name, ...) into volume_context, or that
// pass certificates as secrets, may exceed that, so berth allows sixteen
// times as much. Real volumes use tens of entries and a few KiB.
const (
	// maxMapEntries bounds the entries of each of volume_context,
	// publish_context and secrets.
	maxMapEntries = 128
	// maxMapBytes bounds the keys and values of each of those maps
	// together.
	maxMapBytes = 64 << 10
	// maxMountFlags bounds the number of mount_flags.
	maxMountFlags = 64
	// maxMountFlagsBytes bounds mount_flags joined by commas: the kernel
	// takes at most one page of mount data.
	maxMountFlagsBytes = 4096
)

// mapBytes is the size of a map's keys and values together.
func mapBytes(m map[string]string) int {
	n := 0
	for k, v := range m {
		n += len(k) + len(v)
	}
	return n
}

// checkMapSize refuses a map beyond maxMapEntries or maxMapBytes. The
// entries are counted first, so the bytes are summed over at most
// maxMapEntries entries.
func checkMapSize(field string, m map[string]string) error {
	if len(m) > maxMapEntries {
		return errdefs.InvalidArgument("%s: %d entries, the limit is %d", field, len(m), maxMapEntries)
	}
	if n := mapBytes(m); n > maxMapBytes {
		return errdefs.InvalidArgument("%s: %d bytes of keys and values, the limit is %d bytes", field, n, maxMapBytes)
	}
	return nil
}

// validateSecrets checks the size of a request's secrets; what they hold
// is the transport's business. The error names no secret.
func validateSecrets(secrets map[string]string) error {
	return checkMapSize("secrets", secrets)
}

// hasControl reports whether s holds a byte below 0x20 or DEL. Such bytes
// (NUL, newline, escape sequences) have no business in identifiers or paths
// and would corrupt logs, mount tables and kernel option strings.
func hasControl(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == 0x7f {
			return true
		}
	}
	return false
}

// validateVolumeID checks a volume_id. IDs are opaque to berth; they are
// never used as paths (see stateFileName).
func validateVolumeID(id string) error {
	switch {
	case id == "":
		return errdefs.InvalidArgument("volume_id: missing")
	case len(id) > maxIDLen:
		return errdefs.InvalidArgument("volume_id: %d bytes, the CSI limit is %d", len(id), maxIDLen)
	case !utf8.ValidString(id):
		return errdefs.InvalidArgument("volume_id: not valid UTF-8")
	case hasControl(id):
		return errdefs.InvalidArgument("volume_id %q: contains control characters", id)
	}
	return nil
}

// validatePath checks the form of a staging or target path without
// touching the filesystem: absolute, clean (no "..", "//", "." or trailing
// slash), not the root, no control characters.
func validatePath(field, p string) error {
	switch {
	case p == "":
		return errdefs.InvalidArgument("%s: missing", field)
	case len(p) > maxPathLen:
		return errdefs.InvalidArgument("%s: %d bytes, longer than PATH_MAX", field, len(p))
	case !utf8.ValidString(p):
		return errdefs.InvalidArgument("%s: not valid UTF-8", field)
	case hasControl(p):
		return errdefs.InvalidArgument("%s %q: contains control characters", field, p)
	case !filepath.IsAbs(p):
		return errdefs.InvalidArgument("%s %q: not an absolute path", field, p)
	case filepath.Clean(p) != p:
		return errdefs.InvalidArgument("%s %q: not a clean path (want %q)", field, p, filepath.Clean(p))
	case p == "/":
		return errdefs.InvalidArgument("%s: the root directory cannot be used", field)
	}
	for _, elem := range strings.Split(p, "/") {
		if len(elem) > maxNameLen {
			return errdefs.InvalidArgument("%s %q: a name of %d bytes, longer than NAME_MAX (%d)", field, p, len(elem), maxNameLen)
		}
	}
	return nil
}

// volumeCap is a validated VolumeCapability.
type volumeCap struct {
	Block      bool
	FsType     string   // mount only, defaulted
	MountFlags []string // mount only
	Mode       csi.VolumeCapability_AccessMode_Mode
}

// readOnly reports whether the access mode allows no writer at all.
func (c volumeCap) readOnly() bool {
	return c.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY ||
		c.Mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

// singleWriter reports whether the mode allows one publish target only.
func (c volumeCap) singleWriter() bool {
	return c.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
}

func (c volumeCap) accessType() string {
	if c.Block {
		return "block"
	}
	return "mount"
}

// validateCapability checks a volume_capability: a known access type, an
// access mode berth can honour for it, a supported fs_type and mount flags
// that fs accepts. parseOpts is fs.ParseMountOptions (the allowlist lives
// in fs).
func validateCapability(c *csi.VolumeCapability, fsTypes []string, parseOpts func([]string) (uintptr, string, error)) (volumeCap, error) {
	var vc volumeCap
	if c == nil {
		return vc, errdefs.InvalidArgument("volume_capability: missing")
	}
	if c.GetAccessMode() == nil {
		return vc, errdefs.InvalidArgument("volume_capability.access_mode: missing")
	}
	vc.Mode = c.GetAccessMode().GetMode()
	multiWriter := false
	switch vc.Mode {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
	case csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		multiWriter = true
	default:
		return vc, errdefs.InvalidArgument("volume_capability.access_mode: unknown mode %d", int32(vc.Mode))
	}
	switch at := c.GetAccessType().(type) {
	case *csi.VolumeCapability_Block:
		vc.Block = true
	case *csi.VolumeCapability_Mount:
		m := at.Mount
		if multiWriter {
			// ext4 and xfs are not cluster filesystems: writers on two
			// nodes corrupt them. Raw block is the caller's business.
			return vc, errdefs.InvalidArgument("volume_capability: access mode %s needs access type block; a local filesystem cannot be written from several nodes", vc.Mode)
		}
		if m.GetVolumeMountGroup() != "" {
			return vc, errdefs.InvalidArgument("volume_capability.mount.volume_mount_group: not supported (VOLUME_MOUNT_GROUP is not a node capability)")
		}
		vc.FsType = m.GetFsType()
		if vc.FsType == "" {
			vc.FsType = defaultFsType
		}
		if !slices.Contains(fsTypes, vc.FsType) {
			return vc, errdefs.InvalidArgument("volume_capability.mount.fs_type %q: not supported, use one of %v", vc.FsType, fsTypes)
		}
		if err := checkMountFlagsSize(m.GetMountFlags()); err != nil {
			return vc, err
		}
		for _, f := range m.GetMountFlags() {
			if hasControl(f) || !utf8.ValidString(f) {
				return vc, errdefs.InvalidArgument("volume_capability.mount.mount_flags %q: contains control characters", f)
			}
		}
		if _, _, err := parseOpts(m.GetMountFlags()); err != nil {
			return vc, fmt.Errorf("volume_capability.mount.mount_flags: %w", err)
		}
		vc.MountFlags = slices.Clone(m.GetMountFlags())
	default:
		return vc, errdefs.InvalidArgument("volume_capability: access type missing (want mount or block)")
	}
	return vc, nil
}

// checkMountFlagsSize refuses mount_flags beyond maxMountFlags or
// maxMountFlagsBytes.
func checkMountFlagsSize(flags []string) error {
	if len(flags) > maxMountFlags {
		return errdefs.InvalidArgument("volume_capability.mount.mount_flags: %d flags, the limit is %d", len(flags), maxMountFlags)
	}
	n := len(flags) - 1 // the commas
	for _, f := range flags {
		n += len(f)
	}
	if n > maxMountFlagsBytes {
		return errdefs.InvalidArgument("volume_capability.mount.mount_flags: %d bytes joined, the limit is %d bytes", n, maxMountFlagsBytes)
	}
	return nil
}

// validateContext checks the form of a volume_context or publish_context:
// bounded in size (checkMapSize), keys and values free of control
// characters. What the keys mean is the transport's business
// (Transport.Parse).
func validateContext(field string, m map[string]string) error {
	if err := checkMapSize(field, m); err != nil {
		return err
	}
	for k, v := range m {
		switch {
		case k == "":
			return errdefs.InvalidArgument("%s: empty key", field)
		case len(k) > maxIDLen || len(v) > maxContextLen:
			return errdefs.InvalidArgument("%s[%q]: too long", field, k)
		case hasControl(k) || !utf8.ValidString(k):
			return errdefs.InvalidArgument("%s: key %q contains control characters", field, k)
		case hasControl(v) || !utf8.ValidString(v):
			return errdefs.InvalidArgument("%s[%q]: value contains control characters", field, k)
		}
	}
	return nil
}

// mergeContext merges publish_context into volume_context. A key present
// in both with different values is a conflict, not an override.
func mergeContext(volumeContext, publishContext map[string]string) (map[string]string, error) {
	if err := validateContext("volume_context", volumeContext); err != nil {
		return nil, err
	}
	if err := validateContext("publish_context", publishContext); err != nil {
		return nil, err
	}
	out := make(map[string]string, len(volumeContext)+len(publishContext))
	for k, v := range volumeContext {
		out[k] = v
	}
	for k, v := range publishContext {
		if old, ok := out[k]; ok && old != v {
			return nil, errdefs.InvalidArgument("publish_context[%q] %q conflicts with volume_context value %q", k, v, old)
		}
		out[k] = v
	}
	return out, nil
}
