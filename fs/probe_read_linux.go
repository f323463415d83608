package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/kmutex"
)

// reading holds a key for each device that a probe's reads are on. A
// read of a device that does not answer (a multipath map that queues
// I/O with no path) may never return, and nothing can cancel it; the
// probe's caller is answered at its deadline while the reads go on, and
// they hold the key until they return. The next probe of the device
// waits for the key within its own deadline: it sends no reads of its
// own after the stuck ones.
var reading kmutex.KeyedMutex

// onDevice runs read, the reads of the device at path and what is made
// of them, in a goroutine of its own while it holds the device's key in
// reading, and returns its result. When ctx ends first, onDevice returns
// at once with an error wrapping errdefs.ErrUnavailable and ctx's error;
// read's own ctx ends then too, so it starts no further read or tool.
func onDevice[T any](ctx context.Context, path string, read func(ctx context.Context) (T, error)) (T, error) {
	var zero T
	key, err := deviceKey(path)
	if err != nil {
		return zero, err
	}
	unlock, err := reading.Lock(ctx, key)
	if err != nil {
		return zero, fmt.Errorf("probe %s: an earlier probe's read of the device has not returned by the request's deadline "+
			"(the device answers no I/O: check the paths to the storage and the kernel log): %w",
			path, errors.Join(errdefs.ErrUnavailable, err))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer unlock()
		v, err := read(ctx)
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		if r.err == nil || ctx.Err() == nil {
			return r.v, r.err
		}
		// read failed because ctx ended.
	case <-ctx.Done():
	}
	return zero, fmt.Errorf("probe %s: the device did not answer the probe's reads by the request's deadline "+
		"(check the paths to the storage and the kernel log); the reads go on, and the next probe waits for them: %w",
		path, errors.Join(errdefs.ErrUnavailable, ctx.Err()))
}

// deviceKey names the device at path in reading: its device number, or
// for a regular file its inode.
func deviceKey(path string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return "", fmt.Errorf("probe %s: %w: %w", path, err, errdefs.ErrNotFound)
		}
		return "", fmt.Errorf("probe %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return fmt.Sprintf("block %d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)), nil
	}
	return fmt.Sprintf("file %d:%d %d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino), nil
}

// openForProbe opens path for readEnds and returns its size. The buffer
// cache of a block device is written back and dropped (BLKFLSBUF) first,
// so that every read after it, blkid's and mkfs', finds the medium. The
// file bypasses the cache (O_DIRECT, where the file allows it).
func openForProbe(path string) (*os.File, int64, error) {
	f, err := openDirect(path)
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
		n, err := blockdev.Size(f)
		if err != nil {
			f.Close()
			return nil, 0, fmt.Errorf("probe %s: %w", path, err)
		}
		size = n
		// Where the cache cannot be dropped, Probe's own reads still
		// bypass it.
		_ = blockdev.DropCache(f)
	}
	return f, size, nil
}

// openDirect opens path for reading with O_DIRECT, or without it where
// the file does not allow it (tmpfs).
func openDirect(path string) (*os.File, error) {
	f, err := blockdev.Open(path, unix.O_RDONLY|unix.O_DIRECT)
	if errors.Is(err, unix.EINVAL) {
		f, err = blockdev.Open(path, unix.O_RDONLY)
	}
	return f, err
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
// blocks for each far window (one may straddle a block boundary), and a
// sample for each of sampleWorkers.
var probeBufSize = 2*headSize + blockAlign + len(farWindows)*2*blockAlign + sampleWorkers*sampleSize

// span is a range of the device readEnds reads, into buf.
type span struct {
	off  int64
	want int // bytes of the device in the range
	buf  []byte
	n    int
	err  error
}

// read fills s.buf from the device. The request is rounded up to whole
// blocks, as O_DIRECT needs; the device ends where the range does. Fewer
// bytes than the range holds (a device that shrank) is an error.
func (s *span) read(ctx context.Context, f *os.File) {
	s.n, s.err = readAtFull(ctx, f, s.buf[:min(len(s.buf), roundUp(s.want, blockAlign))], s.off)
	if s.err == nil && s.n < s.want {
		s.err = fmt.Errorf("read %d bytes at offset %d, expected %d: did the device shrink?", s.n, s.off, s.want)
	}
	s.n = min(s.n, s.want)
}

func (s *span) data() []byte { return s.buf[:s.n] }

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// readEnds reads the first and the last MiB of f, of the given size, and
// the far windows between them, all at once: a network device answers
// them in about one round trip. The first block is read on its own, and
// onData is called as soon as it holds a non-zero byte. When it does
// not, the samples between the ends are read as well, alongside the
// rest. No read starts once ctx has ended.
func readEnds(ctx context.Context, f *os.File, path string, size int64, onData func()) (ends, error) {
	e := ends{farNonZero: -1, sampleNonZero: -1}
	e.tailStart = max(0, (size-headSize)&^(blockAlign-1))
	buf, err := alignedBuffer(probeBufSize)
	if err != nil {
		return e, fmt.Errorf("probe %s: %w", path, err)
	}
	// Unmapped once every read into it has returned (wg.Wait below).
	defer unix.Munmap(buf)
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
	wg.Go(func() { tail.read(ctx, f) })
	if head.want > 0 {
		wg.Go(func() { head.read(ctx, f) })
	}
	if len(far) > 0 {
		// Small reads: one after the other on one thread.
		wg.Go(func() {
			for _, s := range far {
				if s.read(ctx, f); s.err != nil {
					return
				}
			}
		})
	}
	first.read(ctx, f)
	if first.err == nil {
		if firstNonZero(first.data()) >= 0 {
			onData()
		} else if offs := sampleOffsets(size, e.tailStart); len(offs) > 0 {
			wg.Go(func() { e.sampleNonZero, sampleErr = readSamples(ctx, f, offs, e.tailStart, sampleBuf) })
		}
	}
	wg.Wait()
	for _, s := range append([]*span{first, head, tail}, far...) {
		if s.err != nil {
			return e, readError(path, s.err)
		}
	}
	if sampleErr != nil {
		return e, readError(path, fmt.Errorf("sample: %w", sampleErr))
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

// readSamples reads the samples at offs (ascending, below tail) and
// returns the device offset of the first non-zero byte of the lowest
// sample holding one, or -1. Up to sampleWorkers threads read at once,
// each into its own sampleSize part of buf. Samples above one found
// holding data are not read, nor any once ctx has ended.
func readSamples(ctx context.Context, f *os.File, offs []int64, tail int64, buf []byte) (int64, error) {
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
				if s.read(ctx, f); s.err != nil {
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

// readError is the error of a probe whose read of the device failed (an
// I/O error, a device that shrank): what the device holds is unknown,
// which is never blank.
func readError(path string, err error) error {
	return fmt.Errorf("probe %s: %w; berth cannot tell what the device holds and does not format it "+
		"(check the device and the kernel log): %w", path, err, errdefs.ErrFailedPrecondition)
}

// readAt is the one read of the device the probe makes: pread(2).
// Tests replace it with a device that fails or does not answer.
var readAt = (*os.File).ReadAt

// readAtFull reads into buf at off until buf is full or the file ends.
// It starts no read once ctx has ended.
func readAtFull(ctx context.Context, f *os.File, buf []byte, off int64) (int, error) {
	n := 0
	for n < len(buf) {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		m, err := readAt(f, buf[n:], off+int64(n))
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
