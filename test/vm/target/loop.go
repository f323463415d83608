package target

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// backing is a sparse file in tmpfs attached to a loop device.
type backing struct {
	file string
	dev  string // /dev/loopN
}

func newBacking(t testing.TB, size int64) *backing {
	t.Helper()
	LoadModules(t, "loop")
	f, err := os.CreateTemp(t.TempDir(), "backing-*.img")
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		t.Fatal(err)
	}
	defer f.Close()
	dev, err := attachLoop(f)
	if err != nil {
		t.Fatalf("loop device for %s: %v", f.Name(), err)
	}
	b := &backing{file: f.Name(), dev: dev}
	t.Cleanup(func() {
		if err := detachLoop(b.dev); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return b
}

// grow enlarges the backing file and tells the loop device.
func (b *backing) grow(size int64) error {
	if err := os.Truncate(b.file, size); err != nil {
		return err
	}
	f, err := os.Open(b.dev)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("LOOP_SET_CAPACITY %s: %w", b.dev, err)
	}
	return nil
}

func attachLoop(f *os.File) (string, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return "", err
	}
	defer ctl.Close()
	for range 16 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		l, err := os.OpenFile(dev, os.O_RDWR, 0)
		if err != nil {
			return "", err
		}
		cfg := unix.LoopConfig{Fd: uint32(f.Fd())}
		copy(cfg.Info.File_name[:], filepath.Base(f.Name()))
		err = unix.IoctlLoopConfigure(int(l.Fd()), &cfg)
		l.Close()
		if errors.Is(err, unix.EBUSY) {
			continue // taken between GET_FREE and CONFIGURE
		}
		if err != nil {
			return "", fmt.Errorf("LOOP_CONFIGURE %s: %w", dev, err)
		}
		return dev, nil
	}
	return "", errors.New("no free loop device")
}

func detachLoop(dev string) error {
	l, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer l.Close()
	if err := unix.IoctlSetInt(int(l.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		return fmt.Errorf("LOOP_CLR_FD %s: %w", dev, err)
	}
	return nil
}
