package blockdev

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestHeld(t *testing.T) {
	dev, img := newLoop(t)

	if held, err := Held(dev); held || err != nil {
		t.Fatalf("Held(free loop device) = %v, %v", held, err)
	}
	// An exclusive opener: what a mount or a dm table is to the kernel.
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if held, err := Held(dev); !held || err != nil {
		t.Errorf("Held(claimed loop device) = %v, %v; want true", held, err)
	}
	unix.Close(fd)
	if held, err := Held(dev); held || err != nil {
		t.Errorf("Held(released loop device) = %v, %v", held, err)
	}
	if _, err := Held(img); !errors.Is(err, unix.ENOTBLK) {
		t.Errorf("Held(regular file) = %v, want ENOTBLK", err)
	}
	if _, err := Held(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Held(missing) = %v, want ENOENT", err)
	}
}

// A device whose open waits (a SCSI disk in error recovery waits for the
// recovery before any open) stalls only the check: programs berth starts
// for other volumes still start, and other checks still answer. The
// open here is a stand-in that waits; iscsi's TestFaultMultipathISCSIStuckDisk
// has a disk in error recovery make it wait in a guest.
func TestHeldWaitingOpenStallsNothingElse(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices)")
	}
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", "--", img).Output()
	if err != nil {
		t.Fatal(err)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "--detach", dev).Run() })

	stuck, release := "/dev/stuck-disk", make(chan struct{})
	real := openShared
	openShared = func(path string) (int, error) {
		if path == stuck {
			<-release
			return -1, unix.EIO
		}
		return real(path)
	}
	t.Cleanup(func() { openShared = real })
	done := make(chan error, 1)
	go func() {
		_, err := Held(stuck)
		done <- err
	}()
	time.Sleep(100 * time.Millisecond) // the check is in its open
	ran := make(chan error, 1)
	go func() { ran <- exec.Command("true").Run() }()
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("a program started beside the waiting check: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("no program could start while a check waited in its open")
	}
	if held, err := Held(dev); held || err != nil {
		t.Errorf("another device's check beside the waiting one: %v, %v", held, err)
	}
	close(release)
	if err := <-done; !errors.Is(err, unix.EIO) {
		t.Errorf("the waiting check: %v, want EIO", err)
	}
}

// Size, Flush and the read-only flag on a loop device: a write through the
// device's buffer cache is in the backing file once Flush returns, and the
// block layer refuses writes while the flag is set.
func TestSizeFlushReadOnly(t *testing.T) {
	dev, img := newLoop(t)

	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if n, err := Size(f); n != 16<<20 || err != nil {
		t.Errorf("Size = %d, %v; want %d", n, err, 16<<20)
	}
	if n, err := LogicalBlockSize(f); n != 512 || err != nil {
		t.Errorf("LogicalBlockSize = %d, %v; want 512", n, err)
	}

	marker := []byte("written through the buffer cache")
	if _, err := f.WriteAt(marker, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := Flush(f); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	got := make([]byte, len(marker))
	b, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := b.ReadAt(got, 1<<20); err != nil || string(got) != string(marker) {
		t.Errorf("backing file after Flush holds %q (%v); want %q", got, err, marker)
	}

	if ro, err := ReadOnly(f); ro || err != nil {
		t.Fatalf("ReadOnly before SetReadOnly = %v, %v", ro, err)
	}
	if err := SetReadOnly(f, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { SetReadOnly(f, false) })
	if ro, err := ReadOnly(f); !ro || err != nil {
		t.Errorf("ReadOnly after SetReadOnly(true) = %v, %v", ro, err)
	}
	if _, err := f.WriteAt(marker, 2<<20); err == nil {
		t.Errorf("write to %s succeeded with the read-only flag set", dev)
	}
	if err := SetReadOnly(f, false); err != nil {
		t.Fatal(err)
	}
	if ro, err := ReadOnly(f); ro || err != nil {
		t.Errorf("ReadOnly after SetReadOnly(false) = %v, %v", ro, err)
	}

	// Not a block device: the ioctl's error, never a size.
	if n, err := Size(b); err == nil {
		t.Errorf("Size(regular file) = %d, nil; want an error", n)
	}
}

// newLoop attaches a loop device over a new 16 MiB image and returns both.
func newLoop(t *testing.T) (dev, img string) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("BERTH_CI") != "" {
			t.Fatal("needs root (loop devices)")
		}
		t.Skip("needs root (loop devices)")
	}
	img = filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", "--", img).Output()
	if err != nil {
		t.Fatal(err)
	}
	dev = strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "--detach", dev).Run() })
	return dev, img
}
