package fs

import (
	"testing"

	"golang.org/x/sys/unix"
)

func TestMountFlagsMatchKernel(t *testing.T) {
	for _, c := range []struct {
		name      string
		ours, sys uintptr
	}{
		{"MS_RDONLY", MS_RDONLY, unix.MS_RDONLY},
		{"MS_NOSUID", MS_NOSUID, unix.MS_NOSUID},
		{"MS_NODEV", MS_NODEV, unix.MS_NODEV},
		{"MS_NOEXEC", MS_NOEXEC, unix.MS_NOEXEC},
		{"MS_SYNCHRONOUS", MS_SYNCHRONOUS, unix.MS_SYNCHRONOUS},
		{"MS_REMOUNT", MS_REMOUNT, unix.MS_REMOUNT},
		{"MS_DIRSYNC", MS_DIRSYNC, unix.MS_DIRSYNC},
		{"MS_NOATIME", MS_NOATIME, unix.MS_NOATIME},
		{"MS_NODIRATIME", MS_NODIRATIME, unix.MS_NODIRATIME},
		{"MS_BIND", MS_BIND, unix.MS_BIND},
		{"MS_RELATIME", MS_RELATIME, unix.MS_RELATIME},
		{"MS_STRICTATIME", MS_STRICTATIME, unix.MS_STRICTATIME},
		{"MS_LAZYTIME", MS_LAZYTIME, unix.MS_LAZYTIME},
	} {
		if c.ours != c.sys {
			t.Errorf("%s = %#x, kernel %#x", c.name, c.ours, c.sys)
		}
	}
}
