package forklock

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

// While the lock is held no child starts; once released, one does.
func TestHoldDelaysChildren(t *testing.T) {
	release := Hold()
	started := make(chan error, 1)
	go func() { started <- exec.Command(os.Args[0], "-test.run=^$").Run() }()
	select {
	case err := <-started:
		release()
		t.Fatalf("a child ran while the lock was held: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	release()
	if err := <-started; err != nil {
		t.Fatalf("the child after release: %v", err)
	}
}
