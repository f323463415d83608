package fs

import (
	"context"
	"errors"
	"os"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

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
			e, err := readEnds(context.Background(), pf, p, gotSize, func() {})
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
// wholly between two samples is not seen (sampling is not proof).
func TestReadEndsSamples(t *testing.T) {
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
		e, err := readEnds(context.Background(), pf, p, gotSize, func() {})
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

// The samples find the data of the lowest sample holding some, at its
// offset, over many more samples than there are readers.
func TestReadSamples(t *testing.T) {
	const mib = 1 << 20
	const size = 64 * mib
	tail := int64(size - headSize)
	var offs []int64
	for off := int64(headSize); off < tail; off += 512 << 10 {
		offs = append(offs, off)
	}
	if len(offs) <= 4*sampleWorkers {
		t.Fatalf("%d offsets: want several rounds of %d readers", len(offs), sampleWorkers)
	}
	buf, err := alignedBuffer(sampleWorkers * sampleSize)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	for _, at := range [][]int64{nil, {offs[3] + 100}, {offs[3*sampleWorkers+5] + sampleSize - 1}, {offs[len(offs)-1]}, {offs[40] + 7, offs[9] + 1}} {
		p := sparseFile(t, size)
		for _, off := range at {
			writeAt(t, p, off, []byte{0xa5})
		}
		want := int64(-1)
		if len(at) > 0 {
			want = slices.Min(at)
		}
		pf, err := openDirect(p)
		if err != nil {
			t.Fatal(err)
		}
		got, err := readSamples(context.Background(), pf, offs, tail, buf)
		pf.Close()
		if err != nil || got != want {
			t.Errorf("bytes at %v: readSamples = %d, %v; want %d", at, got, err, want)
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

// waitUntil waits up to 10 s for cond, checking it every 10 ms.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("after 10 s: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A device that never answers a read (a multipath map queueing I/O with
// no path) holds the probe's reads, not its caller: Probe returns when
// the request's context ends; a second probe meanwhile waits for the
// stuck reads within its own deadline and sends none of its own; once
// the device answers, every goroutine of both ends and no further read
// is sent for them.
func TestProbeEndsWithContext(t *testing.T) {
	p := sparseFile(t, 64*mib)
	release := make(chan struct{})
	var reads, inRead atomic.Int32
	withReadAt(t, func(f *os.File, b []byte, off int64) (int, error) {
		reads.Add(1)
		inRead.Add(1)
		defer inRead.Add(-1)
		<-release
		return f.ReadAt(b, off)
	})
	goroutines := runtime.NumGoroutine()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		_, err := Probe(ctx, p)
		errc <- err
	}()
	waitUntil(t, "no read started", func() bool { return reads.Load() > 0 })
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, context.Canceled) {
			t.Errorf("Probe of a device that does not answer, cancelled = %v; want Unavailable and Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Probe did not return within 5 s of its context's end")
	}
	stuck := reads.Load()

	start := time.Now()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel2()
	if _, err := Probe(ctx2, p); !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("second Probe during the stuck one = %v; want Unavailable and DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("second Probe returned after %v; its deadline was 200ms", d)
	}
	if n := reads.Load(); n != stuck {
		t.Errorf("second Probe started %d reads of a device whose reads are stuck", n-stuck)
	}

	close(release)
	waitUntil(t, "the stuck reads' goroutines are still running", func() bool {
		return inRead.Load() == 0 && runtime.NumGoroutine() <= goroutines
	})
	if n := reads.Load(); n != stuck {
		t.Errorf("%d reads started after the probes' contexts ended", n-stuck)
	}
	// The device answers again: the next probe reads it.
	if sig, err := Probe(context.Background(), p); err != nil || !sig.Blank() || reads.Load() == stuck {
		t.Errorf("Probe once the device answers = %+v, %v after %d reads; want blank", sig, err, reads.Load()-stuck)
	}
}
