package lockfile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A second Acquire (its own open file, as another process would have) is
// refused with the holder's pid; after Close the lock is free again.
func TestAcquireRefusesHeldLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	l, err := Acquire(path)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil || strings.TrimSpace(string(b)) != strconv.Itoa(os.Getpid()) {
		t.Fatalf("lock file holds %q, %v; want this pid", b, err)
	}
	_, err = Acquire(path)
	var held *HeldError
	if !errors.As(err, &held) || held.PID != os.Getpid() || held.Path != path {
		t.Fatalf("second Acquire: %v, want a HeldError naming pid %d", err, os.Getpid())
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	l2, err := Acquire(path)
	if err != nil {
		t.Fatalf("Acquire after Close: %v", err)
	}
	l2.Close()
}

// The lock file is not reached through a symbolic link.
func TestAcquireRefusesSymlink(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink(filepath.Join(dir, "elsewhere"), filepath.Join(dir, "lock")); err != nil {
		t.Fatal(err)
	}
	if l, err := Acquire(filepath.Join(dir, "lock")); err == nil {
		l.Close()
		t.Fatal("Acquire followed a symbolic link")
	}
	if _, err := os.Lstat(filepath.Join(dir, "elsewhere")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the link's target was created: %v", err)
	}
}

// Wait's shared holds go together; an exclusive one waits for them, and
// they for it, also within one process.
func TestWaitSharedExclusive(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	s1, err := Wait(path, false)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := Wait(path, false)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Lock)
	go func() {
		l, err := Wait(path, true)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	s1.Close()
	select {
	case <-got:
		t.Fatal("an exclusive hold was given while a shared one was held")
	case <-time.After(50 * time.Millisecond):
	}
	s2.Close()
	x := <-got
	if x == nil {
		return
	}
	defer x.Close()
	if l, err := Acquire(path); err == nil {
		l.Close()
		t.Fatal("Acquire took a lock Wait holds exclusively")
	}
}

// WaitContext waits for an exclusive lock until its context ends, takes it
// once it is free, and a lock file removed under a waiter is not held by
// two at once: the waiter locks the file the path names now.
func TestWaitContext(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	first, err := WaitContext(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if l, err := WaitContext(ctx, path); !errors.Is(err, context.DeadlineExceeded) {
		if l != nil {
			l.Close()
		}
		t.Fatalf("WaitContext on a held lock = %v, want the context's deadline", err)
	}

	got := make(chan *Lock, 1)
	go func() {
		l, err := WaitContext(context.Background(), path)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	// The waiter has the old file open (its descriptor and first's).
	for end := time.Now().Add(5 * time.Second); openFiles(t, path) < 2; {
		if time.Now().After(end) {
			t.Fatal("the waiter did not open the lock file")
		}
		time.Sleep(time.Millisecond)
	}
	if err := first.Remove(); err != nil {
		t.Fatal(err)
	}
	second := <-got
	if second == nil {
		return
	}
	defer second.Close()
	// A third caller opens the path anew: it must find the lock held.
	ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if l, err := WaitContext(ctx, path); !errors.Is(err, context.DeadlineExceeded) {
		if l != nil {
			l.Close()
		}
		t.Fatalf("a third caller's WaitContext = %v, want the context's deadline: the waiter locked the removed file", err)
	}
	// Remove after Close removes nothing: the file is the next holder's.
	first.Close()
	if err := first.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("Remove after Close removed the next holder's file: %v", err)
	}
}

// openFiles counts this process's descriptors open on path.
func openFiles(t *testing.T, path string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if to, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && (to == path || to == path+" (deleted)") {
			n++
		}
	}
	return n
}
