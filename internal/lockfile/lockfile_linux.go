package lockfile

import (
	"context"
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

// WaitContext takes the lock at path exclusively, as Wait does, and gives
// up with ctx's error when ctx ends first: it tries the lock without
// blocking, and again after a pause that grows to 50 ms. So the wait is
// not fair: a process whose holds follow each other without a pause
// keeps the lock from a waiter of another process until they pause or
// the waiter's ctx ends. A file that its holder removed (Remove) while
// this call waited on it is let go and the path opened again, so that
// the lock held is always the file the path names.
func WaitContext(ctx context.Context, path string) (*Lock, error) {
	pause := time.Millisecond
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, fmt.Errorf("open lock file %s: %w", path, err)
		}
		for {
			err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
			if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
				break
			}
			select {
			case <-ctx.Done():
				f.Close()
				return nil, fmt.Errorf("wait for lock %s: %w", path, ctx.Err())
			case <-time.After(pause):
			}
			pause = min(2*pause, 50*time.Millisecond)
		}
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if same, err := namesFile(path, f); err != nil {
			f.Close()
			return nil, err
		} else if same {
			return &Lock{f: f}, nil
		}
		f.Close()
	}
}

// namesFile reports whether path still names the open file f.
func namesFile(path string, f *os.File) (bool, error) {
	var held, named unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &held); err != nil {
		return false, fmt.Errorf("lock file %s: %w", path, err)
	}
	if err := unix.Lstat(path, &named); errors.Is(err, unix.ENOENT) {
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("lock file %s: %w", path, err)
	}
	return held.Dev == named.Dev && held.Ino == named.Ino, nil
}

// Remove deletes the file of a lock that WaitContext took, then releases
// the lock: a caller waiting on the file meanwhile opens the path again.
// (Wait and Acquire do not look again, so their files must stay.) After
// Close, or a first Remove, it does nothing: the file may be another
// holder's by then.
func (l *Lock) Remove() error {
	var err error
	l.once.Do(func() {
		err = os.Remove(l.f.Name())
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		err = errors.Join(err, l.f.Close())
	})
	return err
}
