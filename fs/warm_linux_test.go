package fs

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/testutil"
)

// mke2fs' own look at a blank device finds what warmForMke2fs asked for
// in memory: on a loop device it sends a fraction of the reads it sends
// to a device whose cache was just dropped (84 against 14 measured with
// e2fsprogs 1.47), each of which is a round trip on a network device.
func TestWarmForMke2fsSavesMkfsReads(t *testing.T) {
	testutil.RequireRoot(t, "loop devices")
	needTools(t, "mkfs.ext4")
	dev, file := newLoop(t, 256*mib)
	args, err := mkfsArgs("ext4", dev, MkfsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// mkfsReads formats the blank device (warm: after warmForMke2fs) and
	// returns the read requests the device completed meanwhile.
	mkfsReads := func(warm bool) int {
		blankLoop(t, dev, file)
		if warm {
			done := warmForMke2fs(dev)
			defer done()
			waitIdle(t, dev)
		}
		before := deviceReads(t, dev)
		if _, err := runTool(context.Background(), "mkfs.ext4", args...); err != nil {
			t.Fatal(err)
		}
		return deviceReads(t, dev) - before
	}
	cold, warm := mkfsReads(false), mkfsReads(true)
	t.Logf("mkfs.ext4 read requests: %d after the cache was dropped, %d after warmForMke2fs", cold, warm)
	if warm*2 > cold {
		t.Errorf("mkfs.ext4 sent %d reads after warmForMke2fs, %d without: want at most half", warm, cold)
	}
}

// blankLoop makes the loop device over file read as zeros again and
// drops its cache.
func blankLoop(t testing.TB, dev, file string) {
	t.Helper()
	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, fi.Size()); err != nil {
		t.Fatal(err)
	}
	d, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := unix.IoctlSetInt(int(d.Fd()), unix.BLKFLSBUF, 0); err != nil {
		t.Fatal(err)
	}
}

// deviceStat returns the fields of the block device's stat file.
func deviceStat(t *testing.T, dev string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "stat"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(b))
}

func deviceReads(t *testing.T, dev string) int {
	t.Helper()
	n, err := strconv.Atoi(deviceStat(t, dev)[0])
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// waitIdle waits until the device has no request in flight (the stat
// file's ninth field).
func waitIdle(t *testing.T, dev string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for deviceStat(t, dev)[8] != "0" {
		if time.Now().After(deadline) {
			t.Fatalf("%s: requests still in flight after 10 s", dev)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
