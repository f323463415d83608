package fs

import (
	"fmt"
	"math/bits"
	"slices"
	"strconv"

	"github.com/berth-csi/berth/internal/errdefs"
)

// volume_context keys of the filesystem a stage makes on a blank device,
// with aws-ebs-csi-driver's names where it has one, so that a StorageClass
// carries its parameters over. They are used only when berth formats: a
// volume that already has a filesystem is mounted as it is.
const (
	KeyBlockSize       = "blockSize"       // ext4 -b, xfs -b size
	KeyInodeSize       = "inodeSize"       // ext4 -I, xfs -i size
	KeyBytesPerInode   = "bytesPerInode"   // ext4 -i
	KeyNumberOfInodes  = "numberOfInodes"  // ext4 -N
	KeyExt4BigAlloc    = "ext4BigAlloc"    // ext4 -O bigalloc
	KeyExt4ClusterSize = "ext4ClusterSize" // ext4 -C, with bigalloc
	// KeyExt4ReservedPercent is the share of blocks reserved for root
	// (ext4 -m; mke2fs' default is 5).
	KeyExt4ReservedPercent = "ext4ReservedBlocksPercent"
)

// MkfsParams are the geometry of a new filesystem; zero fields are
// mkfs' own defaults.
type MkfsParams struct {
	BlockSize       int64
	InodeSize       int64
	BytesPerInode   int64
	NumberOfInodes  int64
	BigAlloc        bool
	ClusterSize     int64
	ReservedPercent *int64
}

// IsZero reports whether p asks for nothing but mkfs' defaults.
func (p MkfsParams) IsZero() bool { return p == MkfsParams{} }

// ParseMkfsParams reads the mkfs parameters of volume_context for fsType
// and checks each against what that filesystem accepts and a kernel of
// 4 KiB pages mounts. A bad value, or a key the filesystem has no use
// for, is an error wrapping errdefs.ErrInvalidArgument that names the key
// and the valid range.
func ParseMkfsParams(fsType string, vc map[string]string) (MkfsParams, error) {
	var p MkfsParams
	if err := checkFsType(fsType); err != nil {
		return p, err
	}
	num := func(key string, ok func(int64) bool, want string) (int64, error) {
		s, given := vc[key]
		if !given {
			return 0, nil
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || !ok(n) {
			return 0, invalidParam(key, s, fsType, want)
		}
		return n, nil
	}
	pow2 := func(lo, hi int64) func(int64) bool {
		return func(n int64) bool { return n >= lo && n <= hi && bits.OnesCount64(uint64(n)) == 1 }
	}
	ext4Only := []string{KeyBytesPerInode, KeyNumberOfInodes, KeyExt4BigAlloc, KeyExt4ClusterSize, KeyExt4ReservedPercent}
	var err error
	switch fsType {
	case Ext4:
		if p.BlockSize, err = num(KeyBlockSize, pow2(1024, 4096), "1024, 2048 or 4096"); err != nil {
			return p, err
		}
		block := p.BlockSize
		if block == 0 {
			block = 1024 // the smallest block mke2fs picks
		}
		if p.InodeSize, err = num(KeyInodeSize, pow2(128, 4096), "a power of two from 128 to 4096, at most blockSize"); err != nil {
			return p, err
		}
		// mke2fs picks 1 KiB blocks for a small device: a larger inode
		// needs the block size it fits in.
		if p.InodeSize > block {
			return p, invalidParam(KeyInodeSize, vc[KeyInodeSize], fsType, fmt.Sprintf("at most blockSize (%d; give blockSize for inodes above 1024)", block))
		}
		if p.BytesPerInode, err = num(KeyBytesPerInode, func(n int64) bool { return n >= max(1024, p.BlockSize) && n <= 64<<20 }, fmt.Sprintf("%d to %d", max(1024, p.BlockSize), 64<<20)); err != nil {
			return p, err
		}
		if p.NumberOfInodes, err = num(KeyNumberOfInodes, func(n int64) bool { return n >= 16 && n <= 1<<32-1 }, "16 to 4294967295"); err != nil {
			return p, err
		}
		if p.BytesPerInode != 0 && p.NumberOfInodes != 0 {
			return p, invalidParam(KeyNumberOfInodes, vc[KeyNumberOfInodes], fsType, "either "+KeyBytesPerInode+" or "+KeyNumberOfInodes+", not both")
		}
		switch s := vc[KeyExt4BigAlloc]; s {
		case "", "false":
		case "true":
			p.BigAlloc = true
		default:
			return p, invalidParam(KeyExt4BigAlloc, s, fsType, `"true" or "false"`)
		}
		if p.ClusterSize, err = num(KeyExt4ClusterSize, pow2(2*block, block<<16), fmt.Sprintf("a power of two from %d to %d bytes", 2*block, block<<16)); err != nil {
			return p, err
		}
		if p.ClusterSize != 0 && !p.BigAlloc {
			return p, invalidParam(KeyExt4ClusterSize, vc[KeyExt4ClusterSize], fsType, KeyExt4BigAlloc+`: "true" with it`)
		}
		if _, given := vc[KeyExt4ReservedPercent]; given {
			n, err := num(KeyExt4ReservedPercent, func(n int64) bool { return n >= 0 && n <= 50 }, "0 to 50")
			if err != nil {
				return p, err
			}
			p.ReservedPercent = &n
		}
	case XFS:
		for _, k := range ext4Only {
			if s, given := vc[k]; given {
				return p, fmt.Errorf("volume_context %q=%q: an ext4 parameter, xfs has none such: %w", k, s, errdefs.ErrInvalidArgument)
			}
		}
		if p.BlockSize, err = num(KeyBlockSize, pow2(1024, 4096), "1024, 2048 or 4096"); err != nil {
			return p, err
		}
		if p.InodeSize, err = num(KeyInodeSize, pow2(512, 2048), "512, 1024 or 2048"); err != nil {
			return p, err
		}
	}
	return p, nil
}

func invalidParam(key, value, fsType, want string) error {
	return fmt.Errorf("volume_context %q=%q for %s: want %s: %w", key, value, fsType, want, errdefs.ErrInvalidArgument)
}

// args are the mkfs options of p for fsType.
func (p MkfsParams) args(fsType string) []string {
	var a []string
	itoa := func(n int64) string { return strconv.FormatInt(n, 10) }
	switch fsType {
	case Ext4:
		if p.BlockSize != 0 {
			a = append(a, "-b", itoa(p.BlockSize))
		}
		if p.InodeSize != 0 {
			a = append(a, "-I", itoa(p.InodeSize))
		}
		if p.BytesPerInode != 0 {
			a = append(a, "-i", itoa(p.BytesPerInode))
		}
		if p.NumberOfInodes != 0 {
			a = append(a, "-N", itoa(p.NumberOfInodes))
		}
		if p.BigAlloc {
			a = append(a, "-O", "bigalloc")
		}
		if p.ClusterSize != 0 {
			a = append(a, "-C", itoa(p.ClusterSize))
		}
		if p.ReservedPercent != nil {
			a = append(a, "-m", itoa(*p.ReservedPercent))
		}
	case XFS:
		if p.BlockSize != 0 {
			a = append(a, "-b", "size="+itoa(p.BlockSize))
		}
		if p.InodeSize != 0 {
			a = append(a, "-i", "size="+itoa(p.InodeSize))
		}
	}
	return slices.Clip(a)
}
