package fs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// write is bytes written into an image at an offset.
type write struct {
	off int64
	b   []byte
}

// image is a sparse file of size bytes in a test directory, with writes
// written in their order, open for reading.
func image(t *testing.T, size int64, writes ...write) *fileData {
	t.Helper()
	p := filepath.Join(t.TempDir(), "image")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, w := range writes {
		if _, err := f.WriteAt(w.b, w.off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	r, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	d, err := newFileData(r)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func nonZero(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 0x5a
	}
	return b
}

// Every non-zero byte in a data extent is found, at its offset, however
// far from the places the probe samples; holes and written zeros are
// not data.
func TestFirstImageData(t *testing.T) {
	const gib = 1024 * mib
	for _, tc := range []struct {
		name   string
		size   int64 // the device's size
		file   int64 // the file's, when not size
		writes []write
		want   int64
	}{
		{name: "7 bytes at 200 MiB", size: 512 * mib, writes: []write{{200 * mib, nonZero(7)}}, want: 200 * mib},
		{name: "512 bytes at 37 MiB", size: 512 * mib, writes: []write{{37 * mib, nonZero(512)}}, want: 37 * mib},
		{name: "64 bytes before the last MiB", size: 512 * mib, writes: []write{{511*mib - 64, nonZero(64)}}, want: 511*mib - 64},
		{name: "4 KiB at 700 MiB of 1 GiB", size: gib, writes: []write{{700 * mib, nonZero(4 << 10)}}, want: 700 * mib},
		{name: "the last byte", size: 64 * mib, writes: []write{{64*mib - 1, []byte{1}}}, want: 64*mib - 1},
		{name: "the lowest of two", size: 64 * mib, writes: []write{{50 * mib, nonZero(1)}, {9*mib + 3, []byte{0, 0, 0, 7}}}, want: 9*mib + 6},
		{name: "after zeros ending within a read", size: 64 * mib, writes: []write{{0, make([]byte, 3*mib/2)}, {3*mib/2 + 256<<10, []byte{9}}}, want: 3*mib/2 + 256<<10},
		{name: "all sparse", size: gib, want: -1},
		{name: "written zeros", size: 64 * mib, writes: []write{{mib, make([]byte, 8*mib)}, {40 * mib, make([]byte, 4096)}}, want: -1},
		{name: "data past the device's end", size: 64 * mib, file: 128 * mib, writes: []write{{64 * mib, []byte{1}}}, want: -1},
		{name: "a device larger than its file", size: 128 * mib, file: 64 * mib, writes: []write{{63 * mib, make([]byte, mib)}}, want: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := tc.file
			if file == 0 {
				file = tc.size
			}
			got, err := firstImageData(context.Background(), image(t, file, tc.writes...), tc.size, imageReadBound)
			if err != nil || got != tc.want {
				t.Fatalf("firstImageData = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

// More data than the bound is not read: the device must be probed. Data
// within the bound is found even when more follows.
func TestFirstImageDataBound(t *testing.T) {
	ctx := context.Background()
	zeros := image(t, 64*mib, write{0, make([]byte, 8*mib)})
	if got, err := firstImageData(ctx, zeros, 64*mib, 8*mib); err != nil || got != -1 {
		t.Fatalf("8 MiB of zeros, bound 8 MiB: firstImageData = %d, %v; want -1", got, err)
	}
	if got, err := firstImageData(ctx, zeros, 64*mib, 8*mib-1); !errors.Is(err, errNotRead) {
		t.Fatalf("8 MiB of zeros, bound 8 MiB - 1: firstImageData = %d, %v; want errNotRead", got, err)
	}
	early := image(t, 64*mib, write{0, make([]byte, 8*mib)}, write{2 * mib, []byte{1}})
	if got, err := firstImageData(ctx, early, 64*mib, 4*mib); err != nil || got != 2*mib {
		t.Fatalf("data at 2 MiB of 8, bound 4 MiB: firstImageData = %d, %v; want 2 MiB", got, err)
	}
}

// The reads stop when the request's context ends.
func TestFirstImageDataContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d := image(t, 64*mib, write{0, make([]byte, 4*mib)}, write{3 * mib, []byte{1}})
	if got, err := firstImageData(ctx, d, 64*mib, imageReadBound); !errors.Is(err, context.Canceled) {
		t.Fatalf("firstImageData after the context ended = %d, %v; want context.Canceled", got, err)
	}
}

// A filesystem that cannot find data in a file answers lseek SEEK_DATA
// with EINVAL, or reports the whole file as data (the kernel's generic
// lseek): in a sparse file, that is no extent map, and the image is not
// read. A file that is all allocated is read whole either way.
func TestFirstImageDataNoExtentMap(t *testing.T) {
	ctx := context.Background()
	generic := func(d *fileData) func(int, int64, int) (int64, error) {
		return func(_ int, off int64, whence int) (int64, error) {
			switch {
			case off >= d.size:
				return -1, unix.ENXIO
			case whence == unix.SEEK_DATA:
				return off, nil
			}
			return d.size, nil
		}
	}
	einval := func(int, int64, int) (int64, error) { return -1, unix.EINVAL }

	sparse := image(t, 64*mib, write{9 * mib, []byte{1}})
	for name, seek := range map[string]func(int, int64, int) (int64, error){"whole file as data": generic(sparse), "EINVAL": einval} {
		sparse.seek = seek
		if got, err := firstImageData(ctx, sparse, 64*mib, imageReadBound); !errors.Is(err, errNotRead) {
			t.Errorf("%s, a sparse file: firstImageData = %d, %v; want errNotRead", name, got, err)
		}
	}
	full := image(t, 4*mib, write{0, make([]byte, 4*mib)}, write{3 * mib, []byte{1}})
	full.seek = generic(full)
	if got, err := firstImageData(ctx, full, 4*mib, imageReadBound); err != nil || got != 3*mib {
		t.Errorf("whole file as data, a file all allocated: firstImageData = %d, %v; want 3 MiB", got, err)
	}
}

// fakeData is a dataMap whose extents are given.
type fakeData struct {
	extents [][2]int64
	err     error
}

func (f fakeData) nextData(off int64) (int64, int64, bool, error) {
	if f.err != nil {
		return 0, 0, false, f.err
	}
	for _, e := range f.extents {
		if e[1] > off {
			return e[0], e[1], true, nil
		}
	}
	return 0, 0, false, nil
}

func (f fakeData) ReadAt(b []byte, _ int64) (int, error) {
	clear(b)
	return len(b), nil
}

// An extent map that makes no sense is not trusted, and an error from
// it fails the read.
func TestFirstImageDataBadExtents(t *testing.T) {
	ctx := context.Background()
	for name, f := range map[string]fakeData{
		"empty extent":   {extents: [][2]int64{{4096, 4096}}},
		"behind off":     {extents: [][2]int64{{0, mib}, {4096, 2 * mib}}},
		"reversed":       {extents: [][2]int64{{2 * mib, mib}}},
		"not read whole": {err: errNotRead},
	} {
		if got, err := firstImageData(ctx, f, 4*mib, imageReadBound); !errors.Is(err, errNotRead) {
			t.Errorf("%s: firstImageData = %d, %v; want errNotRead", name, got, err)
		}
	}
	eio := fakeData{err: unix.EIO}
	if got, err := firstImageData(ctx, eio, 4*mib, imageReadBound); !errors.Is(err, unix.EIO) {
		t.Errorf("EIO: firstImageData = %d, %v; want EIO", got, err)
	}
}
