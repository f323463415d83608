package fs

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// readEnds reads to the very end of a device of any size: a byte in the
// last sector, or in a far window, of sizes that are not whole blocks is
// seen.
func TestReadEndsOddSizes(t *testing.T) {
	const mib = 1 << 20
	for _, size := range []int64{1000, 5000, mib + 512, mib + 4096 + 512, 5*mib + 3100, 64*mib + 512, 64*mib + 3100} {
		for _, at := range []int64{size - 1, size - 3087*512 + 23, 2*mib + 100, 4*mib + 3} {
			if at < 0 || at >= size {
				continue
			}
			p := sparseFile(t, size)
			writeAt(t, p, at, []byte{0x5a})
			pf, gotSize, err := openForProbe(p)
			if err != nil {
				t.Fatal(err)
			}
			e, err := readEnds(pf, p, gotSize, func() {})
			pf.Close()
			if err != nil {
				t.Fatalf("size %d: %v", size, err)
			}
			found := e.headNonZero == int(at) || (e.tailNonZero >= 0 && e.tailStart+int64(e.tailNonZero) == at) || e.farNonZero == at || e.sampleNonZero == at
			inWindow := at < headSize || at >= size-headSize || at == size-3087*512+23 || at == 2*mib+100 || at == 4*mib+3
			if inWindow && !found {
				t.Errorf("size %d: byte at %d not seen: %+v", size, at, e)
			}
			if zero := e.windowsZero() && e.sampleNonZero < 0; zero == found {
				t.Errorf("size %d, byte at %d: all zero = %v with the byte seen = %v", size, at, zero, found)
			}
		}
	}
}

// The samples see data at the offsets they cover, and only there: data
// wholly between two samples is not seen (sampling is not proof). So
// they do read with native AIO and with threads.
func TestReadEndsSamples(t *testing.T) {
	for _, aio := range []bool{true, false} {
		t.Run(map[bool]string{true: "aio", false: "threads"}[aio], func(t *testing.T) {
			defer func(old bool) { sampleAIO = old }(sampleAIO)
			sampleAIO = aio
			testReadEndsSamples(t)
		})
	}
}

func testReadEndsSamples(t *testing.T) {
	const mib = 1 << 20
	const size = 256 * mib
	for _, tc := range []struct {
		off  int64
		n    int
		seen bool
	}{
		{mib + 8<<10, 4 << 10, true},
		{3 * mib, 4 << 10, true},
		{3*mib + sampleSize - 1, 1, true},
		{64 * mib, mib, true},
		{200*mib + 4<<10, 4 << 10, true}, // 50*size/64
		{130 * mib, 4 << 10, false},      // between 128 MiB and 132 MiB
		{mib + sampleSize, 4 << 10, false},
		{100*mib + 512<<10, 64 << 10, false},
	} {
		b := make([]byte, tc.n)
		for i := range b {
			b[i] = byte(i%251) + 1
		}
		p := sparseFile(t, size)
		writeAt(t, p, tc.off, b)
		pf, gotSize, err := openForProbe(p)
		if err != nil {
			t.Fatal(err)
		}
		e, err := readEnds(pf, p, gotSize, func() {})
		pf.Close()
		if err != nil {
			t.Fatal(err)
		}
		if seen := e.sampleNonZero >= 0; seen != tc.seen || (seen && e.sampleNonZero != tc.off) {
			t.Errorf("%d bytes at %d: sampleNonZero = %d, want seen=%v at that offset", tc.n, tc.off, e.sampleNonZero, tc.seen)
		}
		if !e.windowsZero() {
			t.Errorf("%d bytes at %d: a window is not zero: %+v", tc.n, tc.off, e)
		}
	}
}

// readBatch reads what pread reads, the file's end included, with one
// io_submit for all the ranges.
func TestReadBatch(t *testing.T) {
	if a, b := unsafe.Sizeof(iocb{}), unsafe.Sizeof(ioEvent{}); a != 64 || b != 32 {
		t.Fatalf("iocb is %d bytes, io_event %d; the kernel's are 64 and 32", a, b)
	}
	const size = 300<<10 + 700
	p := filepath.Join(t.TempDir(), "dev")
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i*13 + i>>12 + 1)
	}
	if err := os.WriteFile(p, want, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := openDirect(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	offs := []int64{0, 4096, 64 << 10, 200 << 10, 296 << 10, 300 << 10, 304 << 10}
	buf, err := alignedBuffer(len(offs) * 16 << 10)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	aio, err := newAIOContext(len(offs))
	if err != nil {
		t.Fatal(err)
	}
	defer aio.destroy()
	reads := make([]batchRead, len(offs))
	for i, off := range offs {
		reads[i] = batchRead{off: off, buf: buf[i*16<<10 : (i+1)*16<<10]}
	}
	// Twice: a context serves one batch after another.
	for range 2 {
		if err := aio.readBatch(f, reads); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range reads {
		exp := want[min(size, r.off):min(size, r.off+int64(len(r.buf)))]
		if r.err != nil || r.n != len(exp) || !bytes.Equal(r.buf[:r.n], exp) {
			t.Errorf("at %d: read %d bytes, %v; want %d, same bytes %v", r.off, r.n, r.err, len(exp), bytes.Equal(r.buf[:min(r.n, len(exp))], exp[:min(r.n, len(exp))]))
		}
	}
	// A range the kernel refuses (not aligned for O_DIRECT, where the
	// file is) fails on its own; the others are still read.
	if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err == nil && fl&unix.O_DIRECT != 0 {
		reads := []batchRead{{off: 0, buf: buf[:4096]}, {off: 100, buf: buf[4096:8192]}, {off: 8192, buf: buf[8192:12288]}}
		if err := aio.readBatch(f, reads); err != nil {
			t.Fatal(err)
		}
		if reads[1].err == nil {
			t.Errorf("unaligned read at 100: no error")
		}
		for _, i := range []int{0, 2} {
			if r := reads[i]; r.err != nil || !bytes.Equal(r.buf[:r.n], want[r.off:r.off+4096]) {
				t.Errorf("at %d: %d bytes, %v", r.off, r.n, r.err)
			}
		}
	}
}

// The samples read with native AIO and with threads find the same data
// at the same offset, over more samples than one batch holds.
func TestReadSamplesBatchedAndThreads(t *testing.T) {
	const mib = 1 << 20
	const size = 64 * mib
	tail := int64(size - headSize)
	var offs []int64
	for off := int64(headSize); off < tail; off += 512 << 10 {
		offs = append(offs, off)
	}
	if len(offs) <= sampleBatch {
		t.Fatalf("%d offsets: want more than one batch", len(offs))
	}
	buf, err := alignedBuffer(sampleBatch * sampleSize)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	var aio aioContext
	defer func() { aio.destroy() }()
	for _, at := range []int64{-1, offs[3] + 100, offs[sampleBatch+5] + sampleSize - 1, offs[len(offs)-1]} {
		p := sparseFile(t, size)
		if at >= 0 {
			writeAt(t, p, at, []byte{0xa5})
		}
		pf, err := openDirect(p)
		if err != nil {
			t.Fatal(err)
		}
		got, err := readSamplesBatched(pf, offs, tail, buf, &aio)
		if err != nil {
			t.Fatalf("batched, byte at %d: %v", at, err)
		}
		threads, err := readSamplesThreads(pf, offs, tail, buf)
		pf.Close()
		if err != nil {
			t.Fatalf("threads, byte at %d: %v", at, err)
		}
		if aio == 0 {
			t.Errorf("byte at %d: no AIO context kept for the next call", at)
		}
		if got != at || threads != at {
			t.Errorf("byte at %d: batched found %d, threads %d", at, got, threads)
		}
	}
}

// withReadAt makes every probe read of the test go through read.
func withReadAt(t *testing.T, read func(f *os.File, b []byte, off int64) (int, error)) {
	t.Helper()
	old := readAt
	readAt = read
	t.Cleanup(func() { readAt = old })
}

// fakeTool puts an executable name first in the tool search path: it
// records its arguments in the returned file and exits 0.
func fakeTool(t *testing.T, name string) (calls string) {
	t.Helper()
	dir := t.TempDir()
	calls = filepath.Join(dir, name+".calls")
	script := "#!/bin/sh\necho \"$@\" >> " + calls + "\n"
	if err := os.WriteFile(filepath.Join(dir, name), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	old := toolDirs
	toolDirs = append([]string{dir}, old...)
	t.Cleanup(func() { toolDirs = old })
	return calls
}

// A device that answers the probe's reads with EIO (a failing disk, a
// dm-error target) is not blank: EnsureFilesystem fails with
// FailedPrecondition, naming the I/O error, and never runs mkfs.
func TestHostEnsureFilesystemReadEIO(t *testing.T) {
	needRoot(t)
	needTools(t, "blkid")
	dev, file := newLoop(t, 64*mib)
	calls := fakeTool(t, "mkfs.ext4")
	withReadAt(t, func(*os.File, []byte, int64) (int, error) { return 0, unix.EIO })
	before := hashFile(t, file)
	formatted, err := EnsureFilesystem(context.Background(), dev, Ext4, MkfsOptions{})
	if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) || !errors.Is(err, unix.EIO) {
		t.Errorf("EnsureFilesystem of a device that answers EIO = %v, %v; want FailedPrecondition wrapping EIO", formatted, err)
	}
	if b, err := os.ReadFile(calls); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mkfs.ext4 ran: %q (%v)", b, err)
	}
	if hashFile(t, file) != before {
		t.Error("device bytes changed")
	}
	t.Logf("EnsureFilesystem: %v", err)
}
