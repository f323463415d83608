package fs

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"unicode/utf8"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Filesystem types berth formats and mounts.
const (
	Ext4 = "ext4"
	XFS  = "xfs"
)

// SupportedFsTypes returns the filesystem types EnsureFilesystem, Fsck and
// Resize handle.
func SupportedFsTypes() []string { return []string{Ext4, XFS} }

func checkFsType(fsType string) error {
	switch fsType {
	case Ext4, XFS:
		return nil
	}
	return fmt.Errorf("filesystem type %q: not supported (supported: %s): %w",
		fsType, strings.Join(SupportedFsTypes(), ", "), errdefs.ErrInvalidArgument)
}

// ErrReadOnly marks a change refused because the filesystem that holds
// the path is read-only (EROFS).
var ErrReadOnly = errors.New("read-only filesystem")

// Signature is what Probe found on a device. Type is "" when the device is
// blank.
type Signature struct {
	// Type is the blkid TYPE ("ext4", "xfs", "swap", "crypto_LUKS",
	// "linux_raid_member", "LVM2_member", ...), the partition table type
	// ("gpt", "dos") when only a partition table was found, "gpt-backup"
	// for a lone GPT backup header, "ambivalent" when blkid found several
	// conflicting signatures, or "unknown-data" when nothing was
	// recognised but a byte Probe read (the first or the last MiB, the
	// places libblkid looks, a sample) is not zero.
	Type string
	// Usage is the blkid USAGE ("filesystem", "raid", "crypto", "other"),
	// or "partition_table" for a partition table.
	Usage string
	UUID  string
	Label string
	// PartitionTable is the blkid PTTYPE when a partition table was found
	// alongside (or instead of) a superblock.
	PartitionTable string
	// Offset is where unknown-data was seen: the lowest offset of a
	// non-zero byte Probe read (data may lie between the places read).
	Offset int64
}

// Blank reports whether nothing at all was found.
func (s Signature) Blank() bool { return s.Type == "" && s.PartitionTable == "" }

func (s Signature) String() string {
	if s.Blank() {
		return "no signature"
	}
	var b strings.Builder
	switch s.Type {
	case typeUnknownData:
		fmt.Fprintf(&b, "%s (unrecognised non-zero data, first non-zero byte read at offset %d)", s.Type, s.Offset)
	case typeGPTBackup:
		fmt.Fprintf(&b, "%s (a GPT backup header in the last block, primary GPT erased)", s.Type)
	case typeAmbivalent:
		fmt.Fprintf(&b, "%s (several conflicting signatures)", s.Type)
	default:
		if s.Usage != "" {
			fmt.Fprintf(&b, "%s signature %q", s.Usage, s.Type)
		} else {
			fmt.Fprintf(&b, "signature %q", s.Type)
		}
	}
	if s.UUID != "" {
		fmt.Fprintf(&b, " uuid=%s", s.UUID)
	}
	if s.Label != "" {
		fmt.Fprintf(&b, " label=%q", s.Label)
	}
	if s.PartitionTable != "" && s.PartitionTable != s.Type && s.Type != typeGPTBackup {
		fmt.Fprintf(&b, " and a %q partition table", s.PartitionTable)
	}
	return b.String()
}

const (
	typeUnknownData     = "unknown-data"
	typeGPTBackup       = "gpt-backup"
	typeAmbivalent      = "ambivalent"
	usagePartitionTable = "partition_table"
)

// ErrRecoveryNeedsWrite is matched by the error of a read-only mount
// that the kernel refused because the filesystem's journal needs
// replaying and the device cannot be written: ext4's noload and xfs's
// norecovery mount it without the replay.
var ErrRecoveryNeedsWrite = errors.New("journal recovery needs a writable device")

// MkfsOptions tune EnsureFilesystem's mkfs run.
type MkfsOptions struct {
	// Label is the filesystem label (ext4: up to 16 bytes, xfs: up to 12).
	Label string
	// ExtraArgs are extra mkfs options, each a flag from the tool's
	// allowlist, optionally followed by its value as the next element
	// ("-b", "4096") or attached ("-b4096"). Flags that change what is
	// formatted or bypass checks (-F, -f, -n, -S, -t, -d, -l, -z, ...) and
	// positional arguments are refused.
	ExtraArgs []string
	// Params is the new filesystem's geometry (ParseMkfsParams).
	Params MkfsParams
	// BeforeMkfs, when set, is called by EnsureFilesystem once it found
	// the device blank, right before mkfs starts; an error from it
	// stops the format. A caller records there that it started
	// formatting the device, so that after a crash during mkfs it can
	// finish the format with Format instead of finding mkfs' partial
	// writes refused as unknown data.
	BeforeMkfs func() error
	// Image, when set, is asked by EnsureFilesystem before it probes
	// for the file the device shows from its start, open for reading,
	// and the device's size (see devices.LoopBackingFile); a nil file
	// when there is none. EnsureFilesystem reads the file's data and
	// closes it. With an error or no file, the device is probed.
	Image func() (*os.File, int64, error)
}

// Stats is the usage of a mounted filesystem.
type Stats struct {
	TotalBytes, AvailableBytes, UsedBytes int64
	TotalInodes, FreeInodes, UsedInodes   int64
}

// mkfsFlag says whether an allowlisted mkfs flag takes a value.
type mkfsFlag struct{ takesValue bool }

// Allowlisted mkfs options, by tool. Flags we set ourselves (force, type,
// no-discard, label) and flags that read or write other files are absent.
var (
	mke2fsFlags = map[byte]mkfsFlag{
		'b': {true}, 'C': {true}, 'E': {true}, 'e': {true}, 'G': {true},
		'g': {true}, 'I': {true}, 'i': {true}, 'J': {true}, 'j': {false},
		'm': {true}, 'N': {true}, 'O': {true}, 'o': {true}, 'r': {true},
		'T': {true}, 'U': {true}, 'q': {false}, 'v': {false},
	}
	mkfsXFSFlags = map[byte]mkfsFlag{
		'b': {true}, 'd': {true}, 'i': {true}, 'l': {true}, 'm': {true},
		'n': {true}, 'r': {true}, 's': {true}, 'q': {false},
	}
)

// validateLabel checks a filesystem label for the given type.
func validateLabel(fsType, label string) error {
	max := 16
	if fsType == XFS {
		max = 12
	}
	switch {
	case len(label) > max:
		return fmt.Errorf("filesystem label %q: longer than %d bytes (%s limit): %w", label, max, fsType, errdefs.ErrInvalidArgument)
	case !utf8.ValidString(label):
		return fmt.Errorf("filesystem label %q: not valid UTF-8: %w", label, errdefs.ErrInvalidArgument)
	case strings.HasPrefix(label, "-"):
		return fmt.Errorf("filesystem label %q: starts with '-': %w", label, errdefs.ErrInvalidArgument)
	}
	for _, r := range label {
		if r < 0x20 || r == 0x7f {
			return fmt.Errorf("filesystem label %q: contains a control character: %w", label, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// validateExtraArgs checks user-supplied mkfs arguments against the tool's
// allowlist. Every element is a flag or the value of the flag before it, so
// nothing can be taken for the device operand.
func validateExtraArgs(fsType string, args []string) error {
	allowed := mke2fsFlags
	if fsType == XFS {
		allowed = mkfsXFSFlags
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if strings.ContainsAny(a, "\x00\n") {
			return fmt.Errorf("mkfs argument %q: contains NUL or newline: %w", a, errdefs.ErrInvalidArgument)
		}
		if len(a) < 2 || a[0] != '-' || a[1] == '-' {
			return fmt.Errorf("mkfs argument %q: not an allowed %s option (positional arguments and long options are refused): %w", a, fsType, errdefs.ErrInvalidArgument)
		}
		f, ok := allowed[a[1]]
		if !ok {
			return fmt.Errorf("mkfs argument %q: option -%c is not allowed for %s: %w", a, a[1], fsType, errdefs.ErrInvalidArgument)
		}
		switch {
		case !f.takesValue && len(a) > 2:
			return fmt.Errorf("mkfs argument %q: option -%c takes no value (combined flags are refused): %w", a, a[1], errdefs.ErrInvalidArgument)
		case f.takesValue && len(a) == 2:
			if i+1 >= len(args) {
				return fmt.Errorf("mkfs argument %q: missing value: %w", a, errdefs.ErrInvalidArgument)
			}
			i++
			if v := args[i]; v == "" || strings.ContainsAny(v, "\x00\n") {
				return fmt.Errorf("mkfs argument %q: value %q is empty or contains NUL or newline: %w", a, v, errdefs.ErrInvalidArgument)
			}
		}
	}
	return nil
}

// mkfsArgs builds the argument vector (without the program name) for a
// device that Probe found blank.
func mkfsArgs(fsType, devPath string, opt MkfsOptions) ([]string, error) {
	if err := checkFsType(fsType); err != nil {
		return nil, err
	}
	if err := validateLabel(fsType, opt.Label); err != nil {
		return nil, err
	}
	if err := validateExtraArgs(fsType, opt.ExtraArgs); err != nil {
		return nil, err
	}
	var args []string
	switch fsType {
	case Ext4:
		// -F: our probe proved the device blank; it does not override
		// mke2fs' refusal to format a mounted or busy device (that
		// needs -F twice). -E: no discard pass, lazy table and journal
		// initialisation. -q: no report of the new filesystem's
		// geometry and no progress output, which nobody reads and
		// which costs mke2fs a sixth of its run on a small device
		// (errors still go to stderr).
		args = []string{"-t", "ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"}
	case XFS:
		// -f: our probe proved the device blank (mkfs.xfs still refuses
		// a mounted device). -K: no discard pass. -q: no geometry
		// report.
		args = []string{"-q", "-f", "-K"}
	}
	if opt.Label != "" {
		args = append(args, "-L", opt.Label)
	}
	args = append(args, opt.Params.args(fsType)...)
	args = append(args, opt.ExtraArgs...)
	return append(args, "--", devPath), nil
}
