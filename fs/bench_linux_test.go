package fs

import (
	"context"
	"fmt"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/testutil"
)

// BenchmarkHostFormat measures the first stage's format step on blank
// loop devices: Probe alone, its samples alone (run alongside its other
// reads in Probe), EnsureFilesystem (probe, mkfs, superblock check), and
// mkfs alone with the same arguments, which is the raw step
// EnsureFilesystem is compared with.
func BenchmarkHostFormat(b *testing.B) {
	testutil.RequireRoot(b, "loop devices, mount")
	needTools(b, "blkid", "mkfs.ext4")
	ctx := context.Background()
	for _, size := range []int64{256 * mib, 1024 * mib} {
		file := sparseFile(b, size)
		dev := attachLoop(b, file)
		// blank makes the device read as zeros again, from the medium.
		blank := func() { blankLoop(b, dev, file) }
		name := fmt.Sprintf("%dMiB", size/mib)
		b.Run(name+"/probe", func(b *testing.B) {
			blank()
			for b.Loop() {
				if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
					b.Fatalf("Probe = %+v, %v", sig, err)
				}
			}
		})
		b.Run(name+"/samples", func(b *testing.B) {
			blank()
			f, err := openDirect(dev)
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			buf, err := alignedBuffer(sampleWorkers * sampleSize)
			if err != nil {
				b.Fatal(err)
			}
			defer unix.Munmap(buf)
			tail := (size - headSize) &^ (blockAlign - 1)
			offs := sampleOffsets(size, tail)
			b.ReportMetric(float64(len(offs)), "reads/op")
			for b.Loop() {
				if at, err := readSamples(ctx, f, offs, tail, buf); err != nil || at >= 0 {
					b.Fatalf("readSamples = %d, %v", at, err)
				}
			}
		})
		b.Run(name+"/ensure", func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				blank()
				b.StartTimer()
				if formatted, err := EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{}); err != nil || !formatted {
					b.Fatalf("EnsureFilesystem = %v, %v", formatted, err)
				}
			}
		})
		b.Run(name+"/mkfs", func(b *testing.B) {
			args, err := mkfsArgs(Ext4, dev, MkfsOptions{})
			if err != nil {
				b.Fatal(err)
			}
			for range b.N {
				b.StopTimer()
				blank()
				b.StartTimer()
				if _, err := runTool(ctx, "mkfs.ext4", args...); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
