package lockfile

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Acquire takes the lock at path (an flock(2) on the file, created if
// missing, not through a symbolic link) without waiting, and writes the
// process's pid into it. A lock another process holds is reported as a
// *HeldError naming its pid.
func Acquire(path string) (*Lock, error) {
	// O_CLOEXEC (set by os.OpenFile): the tools berth runs do not inherit
	// the lock.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &HeldError{Path: path, PID: holderPID(f)}
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
	return &Lock{f: f}, nil
}

// Wait takes the lock at path (an flock(2) on the file, created if
// missing, not through a symbolic link), shared or exclusive, waiting
// while another open file of it holds it the other way. Each call opens
// the file anew, so that holds within one process order against each
// other as those of two processes do. Nothing is written into the file.
// The wait has no bound of its own: the holders' work must have one.
func Wait(path string, exclusive bool) (*Lock, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file %s: %w", path, err)
	}
	how := unix.LOCK_SH
	if exclusive {
		how = unix.LOCK_EX
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return &Lock{f: f}, nil
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
