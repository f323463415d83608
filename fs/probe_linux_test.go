package fs

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
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
			p := filepath.Join(t.TempDir(), "dev")
			f, err := os.Create(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := f.Truncate(size); err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt([]byte{0x5a}, at); err != nil {
				t.Fatal(err)
			}
			f.Close()
			pf, gotSize, err := openForProbe(p, false)
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
		p := filepath.Join(t.TempDir(), "dev")
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, tc.n)
		for i := range b {
			b[i] = byte(i%251) + 1
		}
		if _, err := f.WriteAt(b, tc.off); err != nil {
			t.Fatal(err)
		}
		f.Close()
		pf, gotSize, err := openForProbe(p, false)
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

// readPieces reads what one readAtFull reads, the file's end included,
// whatever the piece size.
func TestReadPieces(t *testing.T) {
	const size = 100<<10 + 700
	p := filepath.Join(t.TempDir(), "dev")
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i*7 + i>>12)
	}
	if err := os.WriteFile(p, want, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, off := range []int64{0, 4096, 60 << 10, 96 << 10, size - 100, size} {
		for _, piece := range []int{0, 4096, 12 << 10, 64 << 10, 1 << 20} {
			buf := make([]byte, 64<<10)
			n, err := readPieces(f, buf, off, piece)
			if err != nil {
				t.Fatalf("off %d piece %d: %v", off, piece, err)
			}
			exp := want[off:min(size, off+int64(len(buf)))]
			if n != len(exp) || !bytes.Equal(buf[:n], exp) {
				t.Errorf("off %d piece %d: read %d bytes, want %d, same bytes %v", off, piece, n, len(exp), bytes.Equal(buf[:min(n, len(exp))], exp[:min(n, len(exp))]))
			}
		}
	}
}
