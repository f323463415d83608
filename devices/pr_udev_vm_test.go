//go:build linux

package devices

import (
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/test/vm"
)

// A fence step must not look like a write to udevd: it watches disk
// nodes, and the close of a descriptor opened for writing makes it send
// a change event and probe the whole device again (over the network for
// an iSCSI or NVMe/TCP disk, while the stage probes and formats it).
// Closing OpenPR's descriptor sends no event; a descriptor opened for
// writing, the control, sends one.
func TestGuestUdevWatchPR(t *testing.T) {
	vm.RequireGuest(t)
	l := guestListener(t)
	if !l.Udev() {
		t.Fatal("needs udevd (TestVMDevices/udev)")
	}
	d := backingLoop(t, l, 16<<20)
	run(t, "udevadm", "settle")
	changes := func(what string, fn func() error) int {
		t.Helper()
		var n atomic.Int32
		stop := l.Notify(func(e EventInfo) {
			if e.Action == "change" && filepath.Base(e.DevPath) == d.Name {
				n.Add(1)
			}
		})
		defer stop()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		run(t, "udevadm", "settle")
		time.Sleep(time.Second)
		t.Logf("%s: %d change events of %s", what, n.Load(), d.Name)
		return int(n.Load())
	}
	if n := changes("open for writing and close", func() error {
		f, err := os.OpenFile(d.Path, os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		return f.Close()
	}); n == 0 {
		t.Fatalf("closing %s opened for writing sent no change event: udevd does not watch it, and the check below means nothing", d.Path)
	}
	if n := changes("OpenPR and Close", func() error {
		p, err := OpenPR(d)
		if err != nil {
			return err
		}
		return p.Close()
	}); n != 0 {
		t.Errorf("OpenPR and Close sent %d change events of %s: udevd took it for a write", n, d.Path)
	}
}
