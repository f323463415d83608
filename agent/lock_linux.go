package agent

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// pidLock is an exclusive flock(2) on a file that also holds the pid of
// the process that took it, so that a process refused the lock can say
// which process to stop. The kernel drops the lock when the process ends,
// however it ends; nothing stale is left to clean up. The file itself
// stays: unlinking it would let a third process lock a new file at the
// path while a second one still waits on the old one.
type pidLock struct {
	f    *os.File
	once sync.Once
}

// lockedError is a lock another process holds.
type lockedError struct {
	path string
	pid  int // 0: the holder has not written its pid yet
}

func (e *lockedError) Error() string {
	if e.pid > 0 {
		return fmt.Sprintf("lock %s is held by pid %d", e.path, e.pid)
	}
	return fmt.Sprintf("lock %s is held by a process that has not written its pid yet", e.path)
}

// lockPID takes the lock at path without waiting. A lock another process
// holds is reported as a *lockedError naming its pid.
func lockPID(path string) (*pidLock, error) {
	// O_CLOEXEC (set by os.OpenFile): the tools berth runs do not inherit
	// the lock.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &lockedError{path: path, pid: holderPID(f)}
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, fmt.Errorf("write pid to lock file %s: %w", path, err)
	}
	if _, err := f.WriteAt(pid, 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("write pid to lock file %s: %w", path, err)
	}
	return &pidLock{f: f}, nil
}

// holderPID reads the pid the holder of f's lock wrote. The holder writes
// it right after it took the lock; a file read in between is empty, so it
// is read again a few times. (Read in that same instant, a file that a
// crashed holder left may still show the crashed one's pid.)
func holderPID(f *os.File) int {
	buf := make([]byte, 32)
	for range 5 {
		n, _ := f.ReadAt(buf, 0)
		if pid, err := strconv.Atoi(strings.TrimSpace(string(buf[:n]))); err == nil && pid > 0 {
			return pid
		}
		time.Sleep(10 * time.Millisecond)
	}
	return 0
}

// Close releases the lock. It may be called more than once.
func (l *pidLock) Close() error {
	var err error
	l.once.Do(func() { err = l.f.Close() })
	return err
}
