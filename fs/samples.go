package fs

import "slices"

// Probe's windows cover what libblkid reads, not what applications
// write: a raw block volume used by a database may hold data anywhere,
// with its first and last MiB zero. Before a blank verdict Probe also
// samples the device between its ends: sampleSize bytes at each offset
// sampleOffsets lists. Sampling lowers the chance of formatting over
// data; it does not prove a device blank, since data that lies wholly
// between two samples is not seen.

// sampleSize is how much is read at each sample offset.
const sampleSize = 16 << 10

// sampleWorkers is how many samples are read at once: a thread each, a
// few rounds deep, not ten.
const sampleWorkers = 16

// Where samples are taken (each a multiple of blockAlign):
//   - the start of every MiB from 1 MiB to sampleDenseEnd, where
//     partition-aligned and header-skipping writers start;
//   - every power-of-two MiB offset beyond that;
//   - sampleSpread offsets evenly spaced over the whole device,
//     k*size/sampleSpread for k = 1..sampleSpread-1, rounded down to a
//     block.
const (
	sampleDenseEnd = 16 << 20
	sampleSpread   = 32
)

// sampleOffsets returns the sorted, distinct offsets Probe samples on a
// device of the given size, leaving out what it reads anyway: the first
// headSize bytes and everything from tail on. A sample that would run
// into the tail is read up to it.
func sampleOffsets(size, tail int64) []int64 {
	var offs []int64
	for off := int64(1 << 20); off <= sampleDenseEnd; off += 1 << 20 {
		offs = append(offs, off)
	}
	for off := int64(2 * sampleDenseEnd); off > 0 && off < size; off *= 2 {
		offs = append(offs, off)
	}
	for k := int64(1); k < sampleSpread; k++ {
		// size/sampleSpread*k stays far from overflow; the remainder
		// only moves a point by less than sampleSpread bytes.
		offs = append(offs, (size/sampleSpread*k+k*(size%sampleSpread)/sampleSpread)&^(blockAlign-1))
	}
	offs = slices.DeleteFunc(offs, func(off int64) bool { return off < headSize || off >= tail })
	slices.Sort(offs)
	return slices.Compact(offs)
}
