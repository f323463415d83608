package devices

import "github.com/berth-csi/berth/internal/sysfs"

// Roots names where the trees this package reads are mounted. The zero
// value is the host's own: /sys, /dev and /run/udev; tests point the fields
// at fake trees. A Device remembers the Roots it was read from, and a
// Listener the Roots it was opened with, so that what is done with either
// happens in the same trees.
type Roots struct {
	// Sys is the sysfs tree; the zero value is /sys.
	Sys sysfs.Root
	// Dev holds the device nodes; "" means /dev.
	Dev string
	// UdevRun is udev's runtime directory; "" means /run/udev.
	UdevRun string
}

func (r Roots) dev() string { return orDefault(r.Dev, "/dev") }

func (r Roots) udevRun() string { return orDefault(r.UdevRun, "/run/udev") }

// block is the sysfs directory of the block device with kernel name name.
func (r Roots) block(name string) string { return r.Sys.Path("class", "block", name) }

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
