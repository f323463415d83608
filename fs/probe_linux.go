package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs"
)

// mkfsTimeout bounds one mkfs run.
const mkfsTimeout = 10 * time.Minute

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
func Probe(ctx context.Context, devPath string) (Signature, error) {
	sig, f, err := probe(ctx, devPath, false)
	if f != nil {
		f.Close()
	}
	return sig, err
}

// probe is Probe that also returns the device it read, still open, or
// nil on error; the caller closes it. With cached, Probe reads the first
// MiB and the far windows through the cache it dropped, each read for
// exactly the bytes it asks (no read-ahead), and the kernel keeps those
// pages while the device stays open (it drops them at the last close):
// mkfs.ext4, whose libblkid check reads there before it writes, finds
// them in memory, on a network device one round trip less per read.
// Where the cache cannot be dropped every read bypasses it.
func probe(ctx context.Context, devPath string, cached bool) (Signature, *os.File, error) {
	f, size, err := openForProbe(devPath, cached)
	if err != nil {
		return Signature{}, nil, err
	}
	sig, err := probeOpen(ctx, f, devPath, size)
	if err != nil {
		f.Close()
		return Signature{}, nil, err
	}
	return sig, f, nil
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
	e, endsErr := readEnds(f, devPath, size, func() {
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

// openForProbe opens path for readEnds and returns its size. The buffer
// cache of a block device is written back and dropped (BLKFLSBUF) first,
// so that every read after it, Probe's, blkid's and mkfs', finds the
// medium. The file bypasses the cache (O_DIRECT, where the file allows
// it) unless cached is set and the cache was dropped; then it reads
// through the cache with read-ahead off (POSIX_FADV_RANDOM: each read
// fetches what it asks, not the MiBs around it).
func openForProbe(path string, cached bool) (*os.File, int64, error) {
	open := openDirect
	if cached {
		open = func(path string) (*os.File, error) { return openDevice(path, unix.O_RDONLY) }
	}
	f, err := open(path)
	if err != nil {
		return nil, 0, fmt.Errorf("probe %s: %w", path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("probe %s: %w", path, err)
	}
	size := fi.Size()
	if fi.Mode()&os.ModeDevice != 0 {
		n, err := unix.IoctlGetUint64(int(f.Fd()), unix.BLKGETSIZE64)
		if err != nil {
			f.Close()
			return nil, 0, fmt.Errorf("probe %s: ioctl BLKGETSIZE64: %w", path, err)
		}
		size = int64(n)
		if err := unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0); err != nil && cached {
			// Cached pages may be stale: read past them, on the
			// device already open.
			d, err := reopenDirect(f)
			f.Close()
			if err != nil {
				return nil, 0, fmt.Errorf("probe %s: %w", path, err)
			}
			return d, size, nil
		}
	}
	if cached {
		// Advice only: without it the reads fetch more than they need.
		_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM)
	}
	return f, size, nil
}

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

// alignedBuffer allocates n bytes, page aligned as O_DIRECT requires,
// with its pages already faulted in. Free it with unix.Munmap.
func alignedBuffer(n int) ([]byte, error) {
	buf, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("allocate read buffer: %w", err)
	}
	return buf, nil
}

// probeBufSize is the most readEnds reads at once: the first MiB, the
// last MiB with up to a block more (its start is block aligned), two
// blocks for each far window (one may straddle a block boundary), and
// sampleBatch samples.
var probeBufSize = 2*headSize + blockAlign + len(farWindows)*2*blockAlign + sampleBatch*sampleSize

// probeBufs keeps read buffers between probes: a new mapping costs a
// page fault per page, a new AIO context an RCU grace period when it
// goes, and probes come in bursts (a node's volumes staged at once).
// Once no probe took a buffer for 5 s, they are all released.
var probeBufs = &bufPool{size: probeBufSize, max: 16, idle: 5 * time.Second}

func getProbeBuf() (*probeBuf, error) { return probeBufs.get() }

func putProbeBuf(b *probeBuf) { probeBufs.put(b) }

// probeBuf is a probe's read buffer (see alignedBuffer) and the AIO
// context its samples were read with, 0 until they were.
type probeBuf struct {
	mem []byte
	aio aioContext
}

// release unmaps b and destroys its AIO context. It waits for an RCU
// grace period when b has a context.
func (b *probeBuf) release() {
	unix.Munmap(b.mem)
	b.aio.destroy()
}

// bufPool keeps up to max free buffers of size bytes and releases them
// once none was taken for idle.
type bufPool struct {
	size, max int
	idle      time.Duration

	mu    sync.Mutex
	free  []*probeBuf
	used  time.Time   // when a buffer was last taken
	timer *time.Timer // releases the free buffers once idle
}

func (p *bufPool) get() (*probeBuf, error) {
	p.mu.Lock()
	p.used = time.Now()
	if n := len(p.free); n > 0 {
		b := p.free[n-1]
		p.free = p.free[:n-1]
		p.mu.Unlock()
		return b, nil
	}
	p.mu.Unlock()
	mem, err := alignedBuffer(p.size)
	if err != nil {
		return nil, err
	}
	return &probeBuf{mem: mem}, nil
}

func (p *bufPool) put(b *probeBuf) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) >= p.max {
		go b.release()
		return
	}
	p.free = append(p.free, b)
	if p.timer == nil {
		p.timer = time.AfterFunc(p.idle, p.release)
	}
}

// release releases the free buffers when none was taken for p.idle, and
// looks again later otherwise.
func (p *bufPool) release() {
	p.mu.Lock()
	if p.timer == nil {
		p.mu.Unlock()
		return
	}
	if idle := time.Since(p.used); idle < p.idle {
		p.timer.Reset(p.idle - idle)
		p.mu.Unlock()
		return
	}
	free := p.free
	p.free, p.timer = nil, nil
	p.mu.Unlock()
	for _, b := range free {
		b.release()
	}
}

// span is a range of the device readEnds reads, into buf.
type span struct {
	off  int64
	want int // bytes of the device in the range
	buf  []byte
	n    int
	err  error
}

// read fills s.buf from the device, in pieces of at most piece bytes
// read at once (one read when piece is 0). The request is rounded up to
// whole blocks, as O_DIRECT needs; the device ends where the range does.
// Fewer bytes than the range holds (a device that shrank) is an error.
func (s *span) read(f *os.File, piece int) {
	s.n, s.err = readPieces(f, s.buf[:min(len(s.buf), roundUp(s.want, blockAlign))], s.off, piece)
	if s.err == nil && s.n < s.want {
		s.err = fmt.Errorf("read %d bytes at offset %d, expected %d: did the device shrink?", s.n, s.off, s.want)
	}
	s.n = min(s.n, s.want)
}

// readPieces is readAtFull with buf cut into pieces of at most piece
// bytes, all read at once. Through the cache with read-ahead off, the
// kernel fetches one read's missing pages a device request at a time
// (up to the larger of the queue's max_sectors_kb and read_ahead_kb,
// see readPiece), waiting for each before it sends the next; reads of
// one request each go out together.
func readPieces(f *os.File, buf []byte, off int64, piece int) (int, error) {
	if piece <= 0 || len(buf) <= piece {
		return readAtFull(f, buf, off)
	}
	pieces := (len(buf) + piece - 1) / piece
	got := make([]int, pieces)
	errs := make([]error, pieces)
	var wg sync.WaitGroup
	for i := range pieces {
		lo, hi := i*piece, min(len(buf), (i+1)*piece)
		wg.Go(func() { got[i], errs[i] = readAtFull(f, buf[lo:hi], off+int64(lo)) })
	}
	wg.Wait()
	n := 0
	for i := range pieces {
		if errs[i] != nil {
			return n, errs[i]
		}
		n += got[i]
		if got[i] < min(len(buf), (i+1)*piece)-i*piece {
			break // the file ends here
		}
	}
	return n, nil
}

// readPiece returns the most one buffered read of the block device f
// fetches in one device request when read-ahead is off: the larger of
// its queue's max_sectors_kb and read_ahead_kb (the kernel's
// force_page_cache_ra). It is 0, one read, for a file that is not a
// block device or that bypasses the cache (the kernel sends all of an
// O_DIRECT read's requests at once), and 128 KiB, the kernel's default
// read-ahead, when sysfs does not say.
func readPiece(f *os.File) int {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0
	}
	if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err != nil || fl&unix.O_DIRECT != 0 {
		return 0
	}
	dev := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	kib := 0
	for _, q := range []string{dev + "/queue", dev + "/../queue"} { // a partition's queue is its disk's
		for _, name := range []string{"max_sectors_kb", "read_ahead_kb"} {
			v, err := sysfs.ReadAttr(q + "/" + name)
			if err != nil {
				continue
			}
			if v, err := strconv.Atoi(v); err == nil {
				kib = max(kib, v)
			}
		}
		if kib > 0 {
			break
		}
	}
	if kib <= 0 {
		return 128 << 10
	}
	return max(blockAlign, kib<<10&^(blockAlign-1))
}

func (s *span) data() []byte { return s.buf[:s.n] }

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// readEnds reads the first and the last MiB of f, of the given size, and
// the far windows between them, all at once: a network device answers
// them in about one round trip. The first block is read on its own, and
// onData is called as soon as it holds a non-zero byte. When it does
// not, the samples between the ends are read as well, alongside the
// rest.
func readEnds(f *os.File, path string, size int64, onData func()) (ends, error) {
	e := ends{farNonZero: -1, sampleNonZero: -1}
	e.tailStart = max(0, (size-headSize)&^(blockAlign-1))
	pb, err := getProbeBuf()
	if err != nil {
		return e, fmt.Errorf("probe %s: %w", path, err)
	}
	defer putProbeBuf(pb)
	buf := pb.mem
	tailEnd := 2*headSize + blockAlign
	first := &span{off: 0, want: int(min(blockAlign, size)), buf: buf[:blockAlign]}
	head := &span{off: blockAlign, want: int(max(0, min(headSize, size)-blockAlign)), buf: buf[blockAlign:headSize]}
	tail := &span{off: e.tailStart, want: int(size - e.tailStart), buf: buf[headSize:tailEnd]}
	var far []*span
	for i, r := range farSpans(size, headSize, e.tailStart) {
		at := tailEnd + i*2*blockAlign
		far = append(far, &span{off: r[0], want: int(r[1] - r[0]), buf: buf[at : at+2*blockAlign]})
	}
	sampleBuf := buf[tailEnd+len(farWindows)*2*blockAlign:]
	var sampleErr error

	var wg sync.WaitGroup
	// When f reads through the cache, only the first MiB and the far
	// windows are read through it: mkfs.ext4's own look at the device
	// reads within them, not in the last MiB or at the samples. Those go
	// past the cache, which costs less (no pages to fill and copy).
	piece, past, pastPiece := readPiece(f), f, 0
	if piece > 0 {
		if d, err := reopenDirect(f); err == nil {
			defer d.Close()
			past = d
		} else {
			pastPiece = piece
		}
	}
	wg.Go(func() { tail.read(past, pastPiece) })
	if head.want > 0 {
		wg.Go(func() { head.read(f, piece) })
	}
	if len(far) > 0 {
		// Small reads: one after the other on one thread.
		wg.Go(func() {
			for _, s := range far {
				if s.read(f, 0); s.err != nil {
					return
				}
			}
		})
	}
	first.read(f, 0)
	if first.err == nil {
		if firstNonZero(first.data()) >= 0 {
			onData()
		} else if offs := sampleOffsets(size, e.tailStart); len(offs) > 0 {
			wg.Go(func() { e.sampleNonZero, sampleErr = readSamples(past, offs, e.tailStart, sampleBuf, &pb.aio) })
		}
	}
	wg.Wait()
	for _, s := range append([]*span{first, head, tail}, far...) {
		if s.err != nil {
			return e, fmt.Errorf("probe %s: %w", path, s.err)
		}
	}
	if sampleErr != nil {
		return e, fmt.Errorf("probe %s: sample: %w", path, sampleErr)
	}
	e.headNonZero = firstNonZero(first.data())
	if e.headNonZero < 0 {
		if i := firstNonZero(head.data()); i >= 0 {
			e.headNonZero = blockAlign + i
		}
	}
	t := tail.data()
	e.tailNonZero = firstNonZero(t)
	for _, lbs := range []int{512, 4096} {
		if len(t) >= lbs && bytes.HasPrefix(t[len(t)-lbs:], gptSignature) {
			e.gptBackup = true
		}
	}
	for _, s := range far {
		if i := firstNonZero(s.data()); i >= 0 {
			e.farNonZero = s.off + int64(i)
			break
		}
	}
	return e, nil
}

// readSamples reads the samples at offs (ascending, below tail) into
// buf, which holds sampleBatch samples. It returns the device offset of
// the first non-zero byte of the lowest sample holding one, or -1. The
// samples are read with native AIO, sampleBatch at a time (see
// readBatch); where the kernel offers none, by sampleWorkers threads.
// Samples above one found holding data may not be read. The AIO
// context is *aio, set up on first use and kept there for the next
// call; one that failed is destroyed and left 0.
func readSamples(f *os.File, offs []int64, tail int64, buf []byte, aio *aioContext) (int64, error) {
	if sampleAIO {
		at, err := readSamplesBatched(f, offs, tail, buf, aio)
		if !errors.Is(err, errNoAIO) {
			return at, err
		}
	}
	return readSamplesThreads(f, offs, tail, buf)
}

// sampleAIO is whether readSamples tries native AIO first (tests turn it
// off to cover the threads).
var sampleAIO = true

// readSamplesBatched is readSamples with readBatch: it returns errNoAIO,
// having read nothing, when the kernel offers no AIO.
func readSamplesBatched(f *os.File, offs []int64, tail int64, buf []byte, aio *aioContext) (int64, error) {
	if *aio == 0 {
		c, err := newAIOContext(sampleBatch)
		if err != nil {
			return -1, err
		}
		*aio = c
	}
	batch := min(sampleBatch, len(buf)/sampleSize)
	reads := make([]batchRead, 0, batch)
	for lo := 0; lo < len(offs); lo += batch {
		chunk := offs[lo:min(len(offs), lo+batch)]
		reads = reads[:0]
		for i, off := range chunk {
			want := roundUp(int(min(sampleSize, tail-off)), blockAlign)
			reads = append(reads, batchRead{off: off, buf: buf[i*sampleSize : i*sampleSize+want]})
		}
		if err := aio.readBatch(f, reads); err != nil {
			aio.destroy()
			*aio = 0
			return -1, err
		}
		for i, r := range reads {
			if r.err != nil {
				return -1, r.err
			}
			want := int(min(sampleSize, tail-chunk[i]))
			if r.n < want {
				return -1, fmt.Errorf("read %d bytes at offset %d, expected %d: did the device shrink?", r.n, r.off, want)
			}
			if j := firstNonZero(r.buf[:want]); j >= 0 {
				return chunk[i] + int64(j), nil
			}
		}
	}
	return -1, nil
}

// readSamplesThreads is readSamples with up to sampleWorkers threads
// reading at once, each into its own sampleSize part of buf. Samples
// above one found holding data are not read.
func readSamplesThreads(f *os.File, offs []int64, tail int64, buf []byte) (int64, error) {
	nonZero := make([]int64, len(offs))
	errs := make([]error, len(offs))
	var next, stop atomic.Int64 // next sample to read; none above stop is read
	stop.Store(int64(len(offs)))
	lower := func(i int64) {
		for cur := stop.Load(); i < cur && !stop.CompareAndSwap(cur, i); cur = stop.Load() {
		}
	}
	var wg sync.WaitGroup
	for w := range min(sampleWorkers, len(offs)) {
		b := buf[w*sampleSize : (w+1)*sampleSize]
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(len(offs)) || i > stop.Load() {
					return
				}
				nonZero[i] = -1
				s := span{off: offs[i], want: int(min(sampleSize, tail-offs[i])), buf: b}
				if s.read(f, 0); s.err != nil {
					errs[i] = s.err
					lower(i)
					continue
				}
				if j := firstNonZero(s.data()); j >= 0 {
					nonZero[i] = offs[i] + int64(j)
					lower(i)
				}
			}
		})
	}
	wg.Wait()
	for i := range min(stop.Load()+1, int64(len(offs))) {
		if errs[i] != nil {
			return -1, errs[i]
		}
		if nonZero[i] >= 0 {
			return nonZero[i], nil
		}
	}
	return -1, nil
}

// readAtFull reads into buf at off until buf is full or the file ends.
func readAtFull(f *os.File, buf []byte, off int64) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := f.ReadAt(buf[n:], off+int64(n))
		n += m
		if errors.Is(err, io.EOF) || (err == nil && m == 0) {
			break
		}
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// reopenDirect opens the file f has open once more, for reading with
// O_DIRECT: the same inode (through /proc/self/fd), not its name again.
func reopenDirect(f *os.File) (*os.File, error) {
	return openDevice(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), unix.O_RDONLY|unix.O_DIRECT)
}

// openDirect opens path for reading with O_DIRECT, or without it where
// the file does not allow it (tmpfs).
func openDirect(path string) (*os.File, error) {
	f, err := openDevice(path, unix.O_RDONLY|unix.O_DIRECT)
	if errors.Is(err, unix.EINVAL) {
		f, err = openDevice(path, unix.O_RDONLY)
	}
	return f, err
}

// openDevice opens a block device or file and names the sentinel for the
// common failures.
func openDevice(path string, flags int) (*os.File, error) {
	f, err := os.OpenFile(path, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		switch {
		case errors.Is(err, os.ErrNotExist):
			return nil, fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
		case errors.Is(err, os.ErrPermission):
			return nil, fmt.Errorf("%w: %w", err, errdefs.ErrPermissionDenied)
		}
		return nil, err
	}
	return f, nil
}

// statBlockDevice checks that path is a block device and returns its
// device number.
func statBlockDevice(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("device %s: %w: %w", path, err, errdefs.ErrNotFound)
		}
		return 0, fmt.Errorf("device %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, fmt.Errorf("device %s: not a block device: %w", path, errdefs.ErrInvalidArgument)
	}
	return st.Rdev, nil
}

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
		var dev *os.File
		if sig, dev, err = probe(ctx, devPath, mkfsReadsCache(fsType)); err != nil {
			return false, err
		}
		// Held open until mkfs is done, so that the cache keeps what
		// Probe read.
		defer dev.Close()
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
	if err := mkfs(ctx, devPath, fsType, args); err != nil {
		return false, err
	}
	return true, nil
}

// mkfsReadsCache reports whether mkfs of fsType looks at the device
// through the kernel's cache before it writes, so that Probe's reads are
// worth keeping there: mke2fs' libblkid check does (about 80 small
// reads, most of them in the first 256 KiB); mkfs.xfs drops the cache
// (BLKFLSBUF) and reads with O_DIRECT.
func mkfsReadsCache(fsType string) bool { return fsType == Ext4 }

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
	ok, err := hasSuperblock(devPath, fsType)
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
// what mkfs wrote.
func hasSuperblock(devPath, fsType string) (bool, error) {
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
	n, err := readAtFull(f, buf, 0)
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
