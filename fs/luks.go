package fs

import (
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/berth-csi/berth/internal/errdefs"
)

// LUKS2 encryption of a volume (dm-crypt through cryptsetup). The
// passphrase reaches cryptsetup on its standard input, a pipe
// (--key-file=-): never in its arguments, its environment or a file.
// cryptsetup takes every byte it reads there as the key, a trailing
// newline included.

// TypeLUKS is the blkid TYPE of a LUKS (1 or 2) header.
const TypeLUKS = "crypto_LUKS"

// ErrLUKSDevice marks the refusal of EnsureFilesystem to format a device
// that holds a LUKS header: an encrypted volume, staged without its
// encryption.
var ErrLUKSDevice = errors.New("encrypted volume")

// Defaults of LUKSOptions.
const (
	DefaultLUKSCipher = "aes-xts-plain64"
	DefaultLUKSPBKDF  = "argon2id"
)

// LUKSCiphers are the ciphers a volume may ask for: the XTS ones with a
// 512-bit key (two 256-bit halves), which cryptsetup uses for them by
// default. Others (CBC, ECB, plain IVs) are refused.
var LUKSCiphers = []string{"aes-xts-plain64", "serpent-xts-plain64", "twofish-xts-plain64"}

// LUKSSectorSizes are the encryption sector sizes dm-crypt supports.
var LUKSSectorSizes = []int{512, 1024, 2048, 4096}

// LUKSPBKDFs are the key derivation functions of a LUKS2 key slot.
var LUKSPBKDFs = []string{"argon2id", "argon2i", "pbkdf2"}

// Limits of the key derivation cost options (cryptsetup's own limits).
const (
	minArgon2MemoryKiB = 32
	maxArgon2MemoryKiB = 4 << 20
	minArgon2Iter      = 4
	minPBKDF2Iter      = 1000
	maxPBKDFIter       = 1<<32 - 1
)

// LUKSOptions are the settings of luksFormat. Zero values mean
// cryptsetup's defaults, except SectorSize, which LUKSFormat chooses
// (see there).
type LUKSOptions struct {
	Cipher     string
	SectorSize int
	// PBKDF is the key slot's key derivation function.
	PBKDF string
	// PBKDFMemoryKiB is argon2's memory cost; 0: cryptsetup's
	// benchmark picks it (up to 1 GiB, at most half the RAM).
	PBKDFMemoryKiB int
	// PBKDFIterations fixes the iteration count and skips the
	// benchmark; 0: cryptsetup's benchmark picks it for a 2 s unlock.
	PBKDFIterations int
	// AllowDiscards opens the mapping with discards passed down (see
	// openArgs); not a setting of luksFormat.
	AllowDiscards bool
}

// Validate checks the options; an error wraps errdefs.ErrInvalidArgument.
func (o LUKSOptions) Validate() error {
	if o.Cipher != "" && !slices.Contains(LUKSCiphers, o.Cipher) {
		return fmt.Errorf("cipher %q: not one of %v: %w", o.Cipher, LUKSCiphers, errdefs.ErrInvalidArgument)
	}
	if o.SectorSize != 0 && !slices.Contains(LUKSSectorSizes, o.SectorSize) {
		return fmt.Errorf("sector size %d: not one of %v: %w", o.SectorSize, LUKSSectorSizes, errdefs.ErrInvalidArgument)
	}
	if o.PBKDF != "" && !slices.Contains(LUKSPBKDFs, o.PBKDF) {
		return fmt.Errorf("pbkdf %q: not one of %v: %w", o.PBKDF, LUKSPBKDFs, errdefs.ErrInvalidArgument)
	}
	pbkdf2 := o.PBKDF == "pbkdf2"
	switch {
	case o.PBKDFMemoryKiB != 0 && pbkdf2:
		return fmt.Errorf("pbkdf memory: pbkdf2 has no memory cost: %w", errdefs.ErrInvalidArgument)
	case o.PBKDFMemoryKiB != 0 && (o.PBKDFMemoryKiB < minArgon2MemoryKiB || o.PBKDFMemoryKiB > maxArgon2MemoryKiB):
		return fmt.Errorf("pbkdf memory %d KiB: want %d to %d: %w", o.PBKDFMemoryKiB, minArgon2MemoryKiB, maxArgon2MemoryKiB, errdefs.ErrInvalidArgument)
	case o.PBKDFIterations < 0 || int64(o.PBKDFIterations) > maxPBKDFIter:
		return fmt.Errorf("pbkdf iterations %d: out of range: %w", o.PBKDFIterations, errdefs.ErrInvalidArgument)
	case o.PBKDFIterations != 0 && pbkdf2 && o.PBKDFIterations < minPBKDF2Iter:
		return fmt.Errorf("pbkdf iterations %d: pbkdf2 needs at least %d: %w", o.PBKDFIterations, minPBKDF2Iter, errdefs.ErrInvalidArgument)
	case o.PBKDFIterations != 0 && !pbkdf2 && o.PBKDFIterations < minArgon2Iter:
		return fmt.Errorf("pbkdf iterations %d: argon2 needs at least %d: %w", o.PBKDFIterations, minArgon2Iter, errdefs.ErrInvalidArgument)
	}
	return nil
}

// formatArgs returns cryptsetup's arguments for luksFormat of devPath
// with sector size sectorSize.
func (o LUKSOptions) formatArgs(devPath string, sectorSize int) []string {
	cipher := o.Cipher
	if cipher == "" {
		cipher = DefaultLUKSCipher
	}
	pbkdf := o.PBKDF
	if pbkdf == "" {
		pbkdf = DefaultLUKSPBKDF
	}
	args := []string{"luksFormat", "--type", "luks2", "--batch-mode", "--key-file=-",
		"--cipher", cipher, "--sector-size", strconv.Itoa(sectorSize), "--pbkdf", pbkdf}
	if o.PBKDFMemoryKiB != 0 {
		args = append(args, "--pbkdf-memory", strconv.Itoa(o.PBKDFMemoryKiB))
	}
	if o.PBKDFIterations != 0 {
		args = append(args, "--pbkdf-force-iterations", strconv.Itoa(o.PBKDFIterations))
		if pbkdf != "pbkdf2" {
			// A fixed cost, not scaled with the node's CPUs.
			args = append(args, "--pbkdf-parallel", "1")
		}
	}
	return append(args, "--", devPath)
}

// openArgs returns cryptsetup's arguments for opening devPath as the
// mapping name. --allow-discards is given for this open only, never
// stored in the header (--persistent): it is the volume's setting, read
// at each stage.
func openArgs(devPath, name string, allowDiscards bool) []string {
	args := []string{"open", "--type", "luks2", "--key-file=-"}
	if allowDiscards {
		args = append(args, "--allow-discards")
	}
	return append(args, "--", devPath, name)
}

// luksSectorSize is the encryption sector size for a device with the
// given logical block size and size: want when set (an error when the
// device cannot take it), else 4096 when the device's size is a whole
// number of 4 KiB blocks, else the larger of 512 and the logical block
// size.
func luksSectorSize(want, logical int, size int64) (int, error) {
	if want != 0 {
		switch {
		case want < logical:
			return 0, fmt.Errorf("sector size %d: below the device's logical block size %d: %w", want, logical, errdefs.ErrInvalidArgument)
		case size%int64(want) != 0:
			return 0, fmt.Errorf("sector size %d: the device's size %d is not a multiple of it: %w", want, size, errdefs.ErrInvalidArgument)
		}
		return want, nil
	}
	if logical <= 4096 && size%4096 == 0 {
		return 4096, nil
	}
	return max(512, logical), nil
}

// cryptsetup's exit codes (cryptsetup(8), RETURN CODES).
const (
	cryptsetupExitPermission = 2 // no permission (bad passphrase)
	cryptsetupExitBusy       = 5 // device already exists or device is busy
)

// cryptsetupKind is the errdefs sentinel of a cryptsetup exit code.
func cryptsetupKind(exit int) error {
	switch exit {
	case cryptsetupExitPermission:
		return errdefs.ErrPermissionDenied
	case cryptsetupExitBusy:
		return errdefs.ErrFailedPrecondition
	}
	return nil
}
