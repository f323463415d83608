package devices

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Matchers and listener options only the tests use: the binary matches
// SCSI disks by address (MatchSCSIAddress, a LUN of a session's host) and
// attaches loop devices through AttachLoop, and it always detects udev
// and keeps the default receive buffer.

// MatchSCSI matches a SCSI disk by WWID and, when hctl is not empty, by its
// host:channel:target:lun address or a prefix of it ("3:0:0:" matches every
// LUN of that target; a prefix ending without a colon must match a whole
// field, so "3:0:0:1" does not match "3:0:0:10"). The WWID may be given in the
// kernel's form ("naa.6001405…"), udev's ID_SERIAL form ("36001405…") or as
// "0x6001405…"; an empty wwid matches any disk at the address, which is only
// safe when the caller owns the address (its own iSCSI session).
func MatchSCSI(hctlPrefixOrEmpty, wwid string) Matcher {
	return scsiMatcher{hctl: hctlPrefixOrEmpty, wwid: NormalizeWWID(wwid)}
}

type scsiMatcher struct{ hctl, wwid string }

func (m scsiMatcher) kind() string { return KindSCSI }

func (m scsiMatcher) Match(d *Device) bool {
	if d == nil || d.ID.Kind != KindSCSI {
		return false
	}
	if m.hctl != "" && !hctlHasPrefix(d.ID.HCTL, m.hctl) {
		return false
	}
	if m.wwid == "" {
		return m.hctl != ""
	}
	if NormalizeWWID(d.ID.WWID) == m.wwid {
		return true
	}
	for _, id := range d.designators {
		if NormalizeWWID(id) == m.wwid {
			return true
		}
	}
	return false
}

func (m scsiMatcher) String() string {
	switch {
	case m.hctl == "":
		return fmt.Sprintf("SCSI disk with WWID %s", m.wwid)
	case m.wwid == "":
		return fmt.Sprintf("SCSI disk at %s", m.hctl)
	}
	return fmt.Sprintf("SCSI disk at %s with WWID %s", m.hctl, m.wwid)
}

func hctlHasPrefix(hctl, prefix string) bool {
	if !strings.HasPrefix(hctl, prefix) {
		return false
	}
	rest := hctl[len(prefix):]
	return rest == "" || strings.HasSuffix(prefix, ":") || rest[0] == ':'
}

func (m scsiMatcher) mayMatch(sysPath string) bool {
	if m.hctl == "" {
		return true
	}
	target, err := os.Readlink(filepath.Join(sysPath, "device"))
	return err == nil && hctlHasPrefix(filepath.Base(target), m.hctl)
}

// MatchLoop matches the loop device whose backing file is file. Symbolic
// links in file are resolved first, as the kernel reports the resolved path.
func MatchLoop(backingFile string) Matcher {
	return loopMatcher{file: canonicalFile(backingFile)}
}

// WithUdev forces listening to udev (true) or to the kernel only (false)
// instead of detecting systemd-udevd through /run/udev/control.
func WithUdev(on bool) ListenerOption {
	return func(c *listenerConfig) {
		c.udev = -1
		if on {
			c.udev = 1
		}
	}
}

// WithEventHook calls fn, on the listener's receive goroutine, for every
// uevent received, with its sequence number and arrival time. fn must not
// block.
func WithEventHook(fn func(EventInfo)) ListenerOption {
	return func(c *listenerConfig) { c.hook = fn }
}

// WithRoots reads devices from the trees r names instead of the host's
// /sys, /dev and /run/udev. The Devices the listener returns, and what is
// done with them, keep to those trees.
func WithRoots(r Roots) ListenerOption {
	return func(c *listenerConfig) { c.roots = r }
}

// withBeforeConfigure calls fn with the name of the free loop device an
// attach is about to configure.
func withBeforeConfigure(fn func(name string)) ListenerOption {
	return func(c *listenerConfig) { c.beforeConfigure = fn }
}

// withoutLoopConfigure binds loop devices the way kernels before 5.8 must
// (LOOP_SET_FD, LOOP_SET_STATUS64).
func withoutLoopConfigure() ListenerOption {
	return func(c *listenerConfig) { c.noLoopConfigure = true }
}

// WithReceiveBuffer sets the socket receive buffer in bytes (default 32 MiB;
// SO_RCVBUFFORCE when permitted, SO_RCVBUF otherwise).
func WithReceiveBuffer(n int) ListenerOption {
	return func(c *listenerConfig) { c.rcvbuf = n }
}
