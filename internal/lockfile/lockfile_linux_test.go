package lockfile

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
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
