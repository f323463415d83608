package fs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/logctx"
)

// imageReadBound is the most bytes of an image's data EnsureFilesystem
// reads; README ("What berth guarantees") states it and why.
var imageReadBound int64 = 1 << 30

// imageChunk is how much of a data extent firstImageData reads at once;
// ctx is checked between reads.
const imageChunk = 1 << 20

// errNotRead is wrapped by firstImageData when it cannot tell what an
// image holds: the device must be probed instead.
var errNotRead = errors.New("cannot read all of the image's data")

// dataMap is a file as firstImageData reads it: where its data is, and
// its bytes.
type dataMap interface {
	// nextData returns the first extent of data at or after off,
	// [start, end); ok is false when there is none.
	nextData(off int64) (start, end int64, ok bool, err error)
	ReadAt(b []byte, off int64) (int, error)
}

// firstImageData returns the offset of the first non-zero byte among
// the first size bytes of the image f, or -1 when all of them are zero.
// It reads f's data extents, all of them, and nothing else: the rest of
// the file is holes, which read as zeros, and past the file's end a loop
// device reads zeros too. When the data is more than bound bytes, or
// f's filesystem cannot say where it is (see fileData), the error wraps
// errNotRead. It stops when ctx ends.
func firstImageData(ctx context.Context, f dataMap, size, bound int64) (int64, error) {
	buf := make([]byte, imageChunk)
	read := int64(0)
	for off := int64(0); off < size; {
		start, end, ok, err := f.nextData(off)
		if err != nil || !ok {
			return -1, err
		}
		if start < off || end <= start {
			return -1, fmt.Errorf("%w: its filesystem reported data at [%d, %d) when asked from %d", errNotRead, start, end, off)
		}
		end = min(end, size)
		for off = start; off < end; {
			if err := ctx.Err(); err != nil {
				return -1, err
			}
			b := buf[:min(int64(len(buf)), end-off)]
			if read += int64(len(b)); read > bound {
				return -1, fmt.Errorf("%w: more than %d bytes of it are data", errNotRead, bound)
			}
			n, err := f.ReadAt(b, off)
			if err != nil && !errors.Is(err, io.EOF) {
				return -1, fmt.Errorf("read %d bytes at offset %d: %w", len(b), off, err)
			}
			if i := firstNonZero(b[:n]); i >= 0 {
				return off + int64(i), nil
			}
			if n < len(b) {
				return -1, nil // the file ends here
			}
			off += int64(n)
		}
	}
	return -1, nil
}

// fileData is the dataMap of an open regular file, from lseek(2)
// SEEK_DATA and SEEK_HOLE. A filesystem without them answers EINVAL or
// EOPNOTSUPP, or (the kernel's generic lseek) reports the whole file as
// data; in a file with fewer bytes allocated than its size that answer
// is not the file's extent map, and nextData fails with errNotRead.
type fileData struct {
	f    *os.File
	size int64 // the file's size when it was opened
	// allocated is the bytes the file's filesystem has allocated to
	// it (st_blocks).
	allocated int64
	// seek is lseek(2); tests put a filesystem without SEEK_DATA there.
	seek func(fd int, off int64, whence int) (int64, error)
}

func newFileData(f *os.File) (*fileData, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	return &fileData{f: f, size: st.Size, allocated: st.Blocks * 512, seek: unix.Seek}, nil
}

func (d *fileData) ReadAt(b []byte, off int64) (int, error) { return d.f.ReadAt(b, off) }

func (d *fileData) nextData(off int64) (int64, int64, bool, error) {
	fd := int(d.f.Fd())
	start, err := d.seek(fd, off, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		return 0, 0, false, nil // no data at or after off
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.EOPNOTSUPP):
		return 0, 0, false, fmt.Errorf("%w: its filesystem cannot find data in a file (lseek SEEK_DATA: %w)", errNotRead, err)
	case err != nil:
		return 0, 0, false, fmt.Errorf("lseek SEEK_DATA from %d: %w", off, err)
	}
	end, err := d.seek(fd, start, unix.SEEK_HOLE)
	switch {
	case errors.Is(err, unix.ENXIO):
		return 0, 0, false, nil // the file shrank below start
	case err != nil:
		return 0, 0, false, fmt.Errorf("lseek SEEK_HOLE from %d: %w", start, err)
	}
	if start == 0 && end >= d.size && d.allocated < d.size {
		return 0, 0, false, fmt.Errorf("%w: its filesystem reports all %d bytes as data, but allocated %d bytes to it: it does not report holes",
			errNotRead, d.size, d.allocated)
	}
	return start, end, true, nil
}

// imageData reads the data of the image opt.Image gives, if any (see
// firstImageData). exact is true when every byte of the device was
// found in it: at is then the offset of the first non-zero one, or -1.
// When exact is false the device must be probed; the log says why,
// unless opt has no Image.
func imageData(ctx context.Context, devPath string, opt MkfsOptions) (at int64, exact bool, err error) {
	if opt.Image == nil {
		return -1, false, nil
	}
	notRead := func(why error) (int64, bool, error) {
		logctx.From(ctx, log()).Warn("image data not read whole: the device is probed and sampled instead, which is not proof",
			"device", devPath, "reason", why.Error())
		return -1, false, nil
	}
	f, size, err := opt.Image()
	if err != nil {
		return notRead(err)
	}
	if f == nil {
		return notRead(errors.New("the device does not show a whole image file"))
	}
	defer f.Close()
	d, err := newFileData(f)
	if err != nil {
		return -1, false, fmt.Errorf("probe %s: image: %w", devPath, err)
	}
	release, err := acquireHeavy(ctx, "probe "+devPath)
	if err != nil {
		return -1, false, err
	}
	defer release()
	at, err = firstImageData(ctx, d, size, imageReadBound)
	switch {
	case errors.Is(err, errNotRead):
		return notRead(err)
	case err != nil:
		return -1, false, fmt.Errorf("probe %s: image: %w", devPath, err)
	}
	return at, true, nil
}
