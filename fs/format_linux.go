package fs

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/errdefs"
)

// mkfsTimeout bounds one mkfs run.
const mkfsTimeout = 10 * time.Minute

// EnsureFilesystem makes sure devPath holds a filesystem of fsType. A blank
// device (see Probe) is formatted and formatted is true. A device that
// already holds fsType is left as it is. A device holding anything else is
// refused with an error wrapping errdefs.ErrFailedPrecondition that names
// what was found; its bytes are not changed.
//
// A device that shows an image file (opt.Image) has the image's data
// read first, all of it up to imageReadBound (see firstImageData): all
// zero, and the device is blank without a probe; a non-zero byte, and
// the device is probed, and refused as unknown data at that byte's
// offset unless the probe finds what it holds. Where the data is not
// read whole the device is probed as any other.
//
// Once mkfs has started it runs to completion even if ctx ends, since a
// half-written device would be refused by every later call. If the node
// dies during mkfs, the device is refused as "unknown-data" by later
// calls; a caller that recorded the start of the format in
// opt.BeforeMkfs finishes it with Format.
func EnsureFilesystem(ctx context.Context, devPath, fsType string, opt MkfsOptions) (formatted bool, err error) {
	args, err := mkfsArgs(fsType, devPath, opt)
	if err != nil {
		return false, err
	}
	if _, err := statBlockDevice(devPath); err != nil {
		return false, err
	}
	var sig Signature
	at, exact, err := imageData(ctx, devPath, opt)
	if err != nil {
		return false, err
	}
	if !exact || at >= 0 {
		if sig, err = Probe(ctx, devPath); err != nil {
			return false, err
		}
		if exact && (sig.Blank() || sig.Type == typeUnknownData) {
			// Data the probe recognises nothing in, at its first byte.
			sig = Signature{Type: typeUnknownData, Offset: at}
		}
	}
	switch {
	case sig.Type == fsType:
		return false, nil
	case sig.Type == TypeLUKS:
		return false, fmt.Errorf("format %s as %s: device holds %s, an %w; berth never formats over it: %w",
			devPath, fsType, sig, ErrLUKSDevice, errdefs.ErrFailedPrecondition)
	case !sig.Blank():
		// wipefs clears signatures only: the rest of the old data stays
		// and is still refused as unknown-data.
		erase := "erase its signatures with wipefs -a"
		if sig.Type == typeUnknownData {
			erase = "zero it, for example with blkdiscard --zeroout"
		}
		return false, fmt.Errorf("format %s as %s: device holds %s; refusing to format a device that may hold data "+
			"(check the volume; %s only if its content is not needed): %w",
			devPath, fsType, sig, erase, errdefs.ErrFailedPrecondition)
	}
	if opt.BeforeMkfs != nil {
		if err := opt.BeforeMkfs(); err != nil {
			return false, fmt.Errorf("format %s as %s: %w", devPath, fsType, err)
		}
	}
	if strings.HasPrefix(fsType, "ext") {
		defer warmForMke2fs(devPath)()
	}
	if err := mkfs(ctx, devPath, fsType, args); err != nil {
		return false, err
	}
	return true, nil
}

// warmForMke2fs asks the kernel to read, through the block device's
// cache, where mke2fs' own libblkid check looks before it writes (the
// first MiB and the far windows), each range in as few requests as the
// queue allows and all at once, and keeps the device open until the
// returned func is called: the kernel drops a block device's cache at
// its last close. The probe dropped that cache before it read, so these
// pages come from the medium. On a network device mke2fs then finds
// them in memory, where it would send some seventy small reads one
// after the other. The probe's verdict does not depend on it: a device
// that cannot be opened or read here is formatted all the same, and
// mke2fs reads the device itself.
func warmForMke2fs(devPath string) (done func()) {
	f, err := blockdev.Open(devPath, unix.O_RDONLY)
	if err != nil {
		return func() {}
	}
	size, err := blockdev.Size(f)
	if err != nil {
		f.Close()
		return func() {}
	}
	ranges := append([][2]int64{{0, min(size, headSize)}}, farSpans(size, headSize, size)...)
	for _, r := range ranges {
		// Advice: the reads are sent, not waited for.
		_ = unix.Fadvise(int(f.Fd()), r[0], r[1]-r[0], unix.FADV_WILLNEED)
	}
	return func() { f.Close() }
}

// Format makes fsType on devPath without looking at what the device
// holds, with the same mkfs arguments as EnsureFilesystem, and checks
// the new superblock. It overwrites whatever is there. It is only for a
// device the caller found blank with EnsureFilesystem and started
// formatting (see MkfsOptions.BeforeMkfs), whose mkfs did not finish:
// mkfs' partial writes are what a later probe would refuse.
func Format(ctx context.Context, devPath, fsType string, opt MkfsOptions) error {
	args, err := mkfsArgs(fsType, devPath, opt)
	if err != nil {
		return err
	}
	if _, err := statBlockDevice(devPath); err != nil {
		return err
	}
	return mkfs(ctx, devPath, fsType, args)
}

// mkfs runs mkfs.fsType with args on devPath and checks that the
// superblock is there.
func mkfs(ctx context.Context, devPath, fsType string, args []string) error {
	release, err := acquireHeavy(ctx, "format "+devPath)
	if err != nil {
		return err
	}
	// mkfs is not cancelled with ctx: a mkfs killed halfway leaves a
	// device that is neither blank nor a filesystem, which every later
	// probe refuses. With lazy initialisation and no discard it takes
	// seconds; the cap only bounds a device whose I/O hangs.
	mkfsCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), mkfsTimeout)
	defer cancel()
	_, err = runTool(mkfsCtx, "mkfs."+fsType, args...)
	release()
	if err != nil {
		return fmt.Errorf("format %s as %s: %w", devPath, fsType, err)
	}
	// The device was probed before; reading the new superblock's magic
	// confirms mkfs wrote what was asked (a full probe would read the
	// device again through blkid).
	ok, err := hasSuperblock(mkfsCtx, devPath, fsType)
	if err != nil {
		return fmt.Errorf("format %s as %s: verify: %w", devPath, fsType, err)
	}
	if !ok {
		return fmt.Errorf("format %s as %s: mkfs succeeded but no %s superblock is on the device", devPath, fsType, fsType)
	}
	return nil
}

// Superblock magic numbers checked after mkfs: ext2/3/4 s_magic (little
// endian, at byte 56 of the superblock that starts at 1024) and the xfs
// superblock's "XFSB" at offset 0.
const (
	ext4MagicOffset = 1024 + 56
	xfsMagicOffset  = 0
)

var (
	ext4Magic = []byte{0x53, 0xef}
	xfsMagic  = []byte("XFSB")
)

// hasSuperblock reports whether devPath starts with a superblock of
// fsType: the check that a finished mkfs wrote what was asked, without
// running blkid again. The read bypasses the buffer cache, which keeps
// what mkfs wrote. It ends with ctx, as Probe does (see onDevice). mkfs
// gives it mkfs' own bound, not the request's: with the request's, a
// stage whose deadline passed during mkfs would fail the check, and its
// retry make the format again, as often as mkfs outlasts the deadline.
func hasSuperblock(ctx context.Context, devPath, fsType string) (bool, error) {
	return onDevice(ctx, devPath, func(ctx context.Context) (bool, error) {
		return readSuperblock(ctx, devPath, fsType)
	})
}

func readSuperblock(ctx context.Context, devPath, fsType string) (bool, error) {
	// No BLKFLSBUF here: mkfs has synced, the read bypasses the cache,
	// and the cached metadata mkfs wrote is what the mount reads next.
	f, err := openDirect(devPath)
	if err != nil {
		return false, fmt.Errorf("probe %s: %w", devPath, err)
	}
	defer f.Close()
	const blockSize = 4096
	buf, err := alignedBuffer(blockSize)
	if err != nil {
		return false, fmt.Errorf("probe %s: %w", devPath, err)
	}
	defer unix.Munmap(buf)
	n, err := readAtFull(ctx, f, buf, 0)
	if err != nil {
		return false, fmt.Errorf("probe %s: read the first block: %w", devPath, err)
	}
	b := buf[:n]
	switch fsType {
	case Ext4:
		return len(b) >= ext4MagicOffset+len(ext4Magic) && bytes.Equal(b[ext4MagicOffset:ext4MagicOffset+len(ext4Magic)], ext4Magic), nil
	case XFS:
		return len(b) >= xfsMagicOffset+len(xfsMagic) && bytes.Equal(b[xfsMagicOffset:xfsMagicOffset+len(xfsMagic)], xfsMagic), nil
	}
	return false, nil
}
