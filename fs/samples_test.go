package fs

import (
	"slices"
	"testing"
)

func TestSampleOffsets(t *testing.T) {
	const mib = 1 << 20
	for _, size := range []int64{0, 4096, 2 * mib, 3*mib + 512, 64 * mib, 256 * mib, 1 << 30, 1<<40 + 4096*3, 1 << 50} {
		tail := max(0, (size-headSize)&^(blockAlign-1))
		offs := sampleOffsets(size, tail)
		if len(offs) > 100 {
			t.Errorf("size %d: %d samples", size, len(offs))
		}
		if !slices.IsSorted(offs) || len(slices.Compact(slices.Clone(offs))) != len(offs) {
			t.Errorf("size %d: offsets not sorted and distinct: %v", size, offs)
		}
		for _, off := range offs {
			if off%blockAlign != 0 || off < headSize || off >= tail {
				t.Errorf("size %d: sample at %d (tail %d)", size, off, tail)
			}
		}
		// The dense part, the powers of two and the spread.
		var want []int64
		for _, off := range []int64{mib, 3 * mib, 64 * mib, 128 * mib, 1 << 30, size / sampleSpread * 17 &^ (blockAlign - 1)} {
			if off >= headSize && off < tail {
				want = append(want, off)
			}
		}
		for _, w := range want {
			if _, ok := slices.BinarySearch(offs, w); !ok {
				t.Errorf("size %d: no sample at %d", size, w)
			}
		}
		// No gap of the spread is much wider than size/sampleSpread.
		prev := int64(headSize)
		for _, off := range append(offs, tail) {
			if gap := off - prev; size >= 2*headSize+sampleSpread*blockAlign && gap > size/sampleSpread+blockAlign {
				t.Errorf("size %d: gap of %d bytes before %d", size, gap, off)
			}
			prev = off
		}
	}
}
