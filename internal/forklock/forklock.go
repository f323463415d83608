// Package forklock keeps short-lived descriptors out of the children
// this process starts.
//
// A child starts with a copy of each of its parent's descriptors and
// holds them until its exec closes the close-on-exec ones. Until then a
// copy of a descriptor open on a mount keeps the mount busy (umount
// fails with EBUSY), and a copy of a block device opened with O_EXCL
// keeps the device claimed (mkfs and mount fail with EBUSY), though the
// parent closed its own. Go starts every child with syscall.ForkLock
// held for writing, so a descriptor opened and closed while the lock is
// held for reading reaches no child.
package forklock

import "syscall"

// Hold keeps this process from starting a child until release is
// called. Hold it only across opening, examining and closing
// descriptors: never across an exec (which would wait for release
// forever) or a wait that may be long (every exec waits for it).
func Hold() (release func()) {
	syscall.ForkLock.RLock()
	return syscall.ForkLock.RUnlock
}

// Wait returns when the children being started when it was called have
// reached their exec. A child closes its copies of close-on-exec
// descriptors a moment later, inside that exec, after the parent has
// gone on: a caller that retries what a copy made fail (an unmount that
// found the mount busy) pauses briefly after Wait. Never call Wait while
// holding Hold.
func Wait() {
	// The read lock is free only while no child is being started, and
	// a waiting reader makes the children that follow wait for it.
	release := Hold()
	release()
}
