package fs

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Probe decides that a device is blank without running blkid when every
// byte where a libblkid prober needs a match is zero. No superblock or
// partition-table prober of libblkid matches all-zero bytes: each is
// gated by a non-zero magic, or by non-zero fields or counts, before it
// reads anything else. The gates lie in the first and the last MiB of
// the device, which Probe reads anyway, and in the few far windows
// below. A device with any non-zero byte in them is probed by blkid, and
// so is every device when the node's libblkid is newer than the one the
// windows were checked against (auditedBlkid).
//
// Three kinds of device move gates elsewhere and are always probed by
// blkid: zoned devices (btrfs looks for a superblock at the start of
// zone 1) and CD-ROMs (iso9660 and udf look past the last session's
// offset). A partition is not one of them: blkid reports the parent's
// partition entry for it, which is not a signature on the partition.

// headSize is how much of each end of the device Probe reads itself.
const headSize = 1 << 20

// blockAlign is the alignment of every read Probe does: O_DIRECT needs
// the logical block size, and no device has one larger than a page.
const blockAlign = 4096

// probeWindow is a byte range where libblkid looks for a signature,
// outside the first and the last MiB of a device.
type probeWindow struct {
	// off is the window's offset from the start of the device or, when
	// negative, back from its end.
	off    int64
	length int64
	// who names the probers that read there.
	who string
}

// farWindows lists every gate beyond the first MiB and before the last
// MiB of a device, in libblkid of util-linux 2.38 (Debian 12) to 2.41
// (Debian 13), from each prober's magic table and probe function. The
// farthest are the LUKS2 secondary header at 4 MiB and the Promise
// signature 3087 sectors before the end.
var farWindows = []probeWindow{
	{off: 0x100000, length: 512, who: "VMFS volume member and LUKS2 secondary header (1 MiB)"},
	{off: 0x200000, length: 512, who: "VMFS, bcachefs backup superblock and LUKS2 secondary header (2 MiB)"},
	{off: 0x400000, length: 512, who: "LUKS2 secondary header (4 MiB)"},
	{off: -3087 * 512, length: 512, who: "Promise FastTrack RAID (3087 sectors before the end)"},
}

// span is the block-aligned byte range [start, end) that covers w on a
// device of the given size, clipped to the device. ok is false when no
// byte of w is on the device.
func (w probeWindow) span(size int64) (start, end int64, ok bool) {
	off := w.off
	if off < 0 {
		off += size
	}
	if off < 0 || off >= size {
		return 0, 0, false
	}
	start = off &^ (blockAlign - 1)
	end = min(size, (off+w.length+blockAlign-1)&^(blockAlign-1))
	return start, end, true
}

// farSpans is the list of aligned ranges to read on a device of the
// given size besides [0, head) and [tail, size): the far windows that
// are on the device and not inside those two ranges.
func farSpans(size, head, tail int64) [][2]int64 {
	var out [][2]int64
	for _, w := range farWindows {
		start, end, ok := w.span(size)
		if !ok || end <= head || start >= tail {
			continue
		}
		out = append(out, [2]int64{start, end})
	}
	return out
}

// auditedBlkid is the newest libblkid whose probers farWindows was checked
// against. With a newer one, which may look in new places, Probe always
// runs blkid.
var auditedBlkid = [2]int{2, 41}

// blkidAudited reports whether the node's blkid is built on a libblkid no
// newer than auditedBlkid. It asks blkid once per process; a blkid that
// cannot tell is not trusted.
var blkidAudited = sync.OnceValue(func() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := runTool(ctx, "blkid", "--version")
	if err != nil {
		return false
	}
	v, ok := libblkidVersion(string(out))
	return ok && (v[0] < auditedBlkid[0] || v[0] == auditedBlkid[0] && v[1] <= auditedBlkid[1])
})

// libblkidVersion reads the library version from `blkid --version`:
// "blkid from util-linux 2.38.1  (libblkid 2.38.1, 04-Aug-2022)".
func libblkidVersion(out string) ([2]int, bool) {
	_, rest, ok := strings.Cut(out, "(libblkid ")
	if !ok {
		return [2]int{}, false
	}
	ver, _, _ := strings.Cut(rest, ",")
	parts := strings.SplitN(strings.TrimSpace(ver), ".", 3)
	if len(parts) < 2 {
		return [2]int{}, false
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(leadingDigits(parts[1])) // "41-rc1"
	if err1 != nil || err2 != nil {
		return [2]int{}, false
	}
	return [2]int{major, minor}, true
}

func leadingDigits(s string) string {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return s[:i]
}
