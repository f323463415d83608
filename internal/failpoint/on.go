//go:build failpoints

package failpoint

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"
)

// Enabled reports whether this build has failpoints.
const Enabled = true

var (
	mu    sync.Mutex
	count int
	at    = atoi(os.Getenv("BERTH_FAILPOINT_AT"))
	trace = os.Getenv("BERTH_FAILPOINT_TRACE")
)

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0
	}
	return n
}

// Hit marks a step boundary; see the package documentation. Boundaries
// are counted in the order they are passed; calls are serialised, so
// concurrent operations get distinct numbers.
func Hit(name string) {
	mu.Lock()
	defer mu.Unlock()
	count++
	if trace != "" {
		f, err := os.OpenFile(trace, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err == nil {
			fmt.Fprintf(f, "%d %s\n", count, name)
			f.Close()
		}
	}
	if count == at {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is delivered before anything else runs
	}
}
