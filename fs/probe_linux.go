package fs

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/command"
)

// Probe reports what the device holds. It reads the first and the last
// MiB of the device itself and the few places beyond them where libblkid
// looks for signatures (see farWindows). When every one of those bytes
// is zero, no signature blkid knows can be there. When the first block
// is zero, Probe also samples the device between its ends (see
// sampleOffsets): a non-zero sample is Signature{Type: "unknown-data"}
// at its offset; all of it zero, the device is blank.
// (Zoned devices and CD-ROMs always go to blkid, and so does every device
// when the node's libblkid is newer than the one farWindows was checked
// against.)
// Otherwise it runs `blkid -p -o export`: low-level probing of
// superblocks (all usages: filesystem, raid, crypto, other) and
// partition tables, without the blkid cache. When blkid finds nothing, a
// GPT backup header in the last block gives Signature{Type: "gpt-backup"}
// (blkid ignores a backup header without the protective MBR), and any
// non-zero byte read gives Signature{Type: "unknown-data"} with the
// lowest such offset.
//
// Before reading, the kernel's buffer cache of a block device is flushed
// and dropped (BLKFLSBUF), so that both readers see the medium and not
// pages cached before the device's content changed (a reused loop device,
// a LUN written from another node). Probe's own reads bypass the cache
// (O_DIRECT, where the device allows it). When the first block holds
// data, blkid is started at once and runs while Probe reads the rest.
//
// Probe returns when ctx ends, with an error wrapping
// errdefs.ErrUnavailable, even when a read of the device has not
// returned (a multipath map that queues I/O with no path); the next
// probe of the device waits for that read instead of sending its own
// (see onDevice).
func Probe(ctx context.Context, devPath string) (Signature, error) {
	return onDevice(ctx, devPath, func(ctx context.Context) (Signature, error) {
		f, size, err := openForProbe(devPath)
		if err != nil {
			return Signature{}, err
		}
		defer f.Close()
		return probeOpen(ctx, f, devPath, size)
	})
}

// probeOpen is Probe of the device f, of the given size.
func probeOpen(ctx context.Context, f *os.File, devPath string, size int64) (Signature, error) {
	type blkidResult struct {
		out []byte
		err error
	}
	var blkid chan blkidResult
	startBlkid := func() {
		ch := make(chan blkidResult, 1)
		blkid = ch
		go func() {
			out, err := runTool(ctx, "blkid", "-p", "-o", "export", "--", devPath)
			ch <- blkidResult{out, err}
		}()
	}
	if !blkidAudited() || blkidOnly(f) {
		startBlkid()
	}
	e, endsErr := readEnds(ctx, f, devPath, size, func() {
		if blkid == nil {
			startBlkid()
		}
	})
	if blkid == nil {
		if endsErr != nil {
			return Signature{}, endsErr
		}
		if e.windowsZero() {
			// No libblkid signature can be there: the device is
			// blank unless a sample holds data.
			if e.sampleNonZero >= 0 {
				return Signature{Type: typeUnknownData, Offset: e.sampleNonZero}, nil
			}
			return Signature{}, nil
		}
		startBlkid()
	}
	r := <-blkid
	if endsErr != nil {
		return Signature{}, endsErr
	}
	out, err := r.out, r.err
	exit := 0
	if err != nil {
		var te *command.Error
		if !errors.As(err, &te) || te.ExitCode < 0 {
			return Signature{}, fmt.Errorf("probe %s: %w", devPath, err)
		}
		exit = te.ExitCode
		if exit != blkidExitNotFound && exit != blkidExitAmbivalent {
			return Signature{}, fmt.Errorf("probe %s: %w", devPath, err)
		}
	}
	sig, found, err := signatureFromBlkid(exit, out)
	if err != nil {
		return Signature{}, fmt.Errorf("probe %s: %w", devPath, err)
	}
	if found {
		return sig, nil
	}
	// blkid accepts a GPT only with its protective MBR or primary
	// header; a backup header left at the end still marks a disk that
	// was partitioned.
	if e.gptBackup {
		return Signature{Type: typeGPTBackup, Usage: usagePartitionTable, PartitionTable: "gpt"}, nil
	}
	if off := e.firstData(); off >= 0 {
		return Signature{Type: typeUnknownData, Offset: off}, nil
	}
	return Signature{}, nil
}

// ends is what Probe read itself.
type ends struct {
	headNonZero int   // offset of the first non-zero byte in the first MiB, or -1
	tailNonZero int   // offset of the first non-zero byte in the last MiB, or -1
	farNonZero  int64 // device offset of a non-zero byte in a far window, or -1
	gptBackup   bool  // a GPT header signature in the last logical block
	tailStart   int64
	// sampleNonZero is the device offset of the first non-zero byte of
	// the lowest sample (see sampleOffsets) that holds one, or -1. The
	// samples are read only when the first block is zero.
	sampleNonZero int64
}

// windowsZero reports whether every byte read where libblkid looks was
// zero: the ends and the far windows.
func (e ends) windowsZero() bool {
	return e.headNonZero < 0 && e.tailNonZero < 0 && e.farNonZero < 0 && !e.gptBackup
}

// firstData returns the lowest device offset at which a non-zero byte
// was read, or -1.
func (e ends) firstData() int64 {
	found := []int64{int64(e.headNonZero), e.farNonZero, e.sampleNonZero}
	if e.tailNonZero >= 0 {
		found = append(found, e.tailStart+int64(e.tailNonZero))
	}
	first := int64(-1)
	for _, off := range found {
		if off >= 0 && (first < 0 || off < first) {
			first = off
		}
	}
	return first
}

// gptSignature starts a GPT header (UEFI spec, "EFI PART").
var gptSignature = []byte("EFI PART")

// blkidOnly reports whether f is a device that only blkid can call
// blank (see farWindows): a zoned device or a CD-ROM.
func blkidOnly(f *os.File) bool {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return false
	}
	const scsiCDROMMajor = 11 // sr, <linux/major.h>
	return unix.Major(st.Rdev) == scsiCDROMMajor || isCDROM(f) || isZoned(f)
}

// cdromGetCapability is CDROM_GET_CAPABILITY in <linux/cdrom.h>: it
// succeeds on any CD-ROM driver, which is how libblkid tells one.
const cdromGetCapability = 0x5331

func isCDROM(f *os.File) bool {
	_, err := unix.IoctlGetInt(int(f.Fd()), cdromGetCapability)
	return err == nil
}

// blkGetZoneSz is BLKGETZONESZ, _IOR(0x12, 132, __u32) in
// <linux/blkzoned.h>: the zone size in sectors, 0 for a device that is
// not zoned.
const blkGetZoneSz = 0x80041284

// isZoned reports whether the block device f is zoned. A kernel without
// the ioctl has no zoned devices.
func isZoned(f *os.File) bool {
	n, err := unix.IoctlGetUint32(int(f.Fd()), blkGetZoneSz)
	return err == nil && n != 0
}
