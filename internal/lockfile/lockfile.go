// Package lockfile holds locks on files: an exclusive lock that also names
// the pid of its holder, so that a second process refused the lock can say
// which process to stop (berth's state directory and endpoint), and holds
// that wait, shared or exclusive (the order of iscsiadm's record walks on
// a node), or exclusive within a context (one iSCSI session's work on a
// node), whose holder may remove the file.
package lockfile

import (
	"fmt"
	"os"
	"sync"
)

// Lock is a held lock. The kernel drops it when the process ends, however
// it ends; nothing stale is left to clean up. The file itself stays, but
// for WaitContext's: unlinking it would let a third process lock a new
// file at the path while a second one still waits on the old one, and
// only WaitContext looks, once it holds a file, whether the path still
// names it.
type Lock struct {
	f    *os.File
	once sync.Once
}

// HeldError is a lock another process holds.
type HeldError struct {
	Path string
	PID  int // 0: the holder has not written its pid yet
}

func (e *HeldError) Error() string {
	if e.PID > 0 {
		return fmt.Sprintf("lock %s is held by pid %d", e.Path, e.PID)
	}
	return fmt.Sprintf("lock %s is held by a process that has not written its pid yet", e.Path)
}

// Close releases the lock. It may be called more than once.
func (l *Lock) Close() error {
	var err error
	l.once.Do(func() { err = l.f.Close() })
	return err
}
