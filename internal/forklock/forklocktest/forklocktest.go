// Package forklocktest helps test that descriptors stay out of children.
package forklocktest

import (
	"context"
	"os/exec"
	"sync"
	"testing"
)

// Fork starts children without pause until the test ends, as a busy
// agent does with the other volumes' mkfs and blkid.
func Fork(t testing.TB) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				_ = exec.Command("/bin/true").Run()
			}
		}()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
}
