package agent

import (
	"fmt"
	"sync"

	"github.com/berth-csi/berth/internal/errdefs"
)

// inflight tracks the volumes and paths with an operation in progress.
// It never blocks: a caller that finds a key held is told so at once and
// the CO retries later (kubelet backs off on Aborted). Waiting instead
// would pile up goroutines behind a stuck mount and replay stale requests
// in an order the CO did not choose.
type inflight struct {
	mu   sync.Mutex
	held map[string]struct{}
}

func newInflight() *inflight {
	return &inflight{held: make(map[string]struct{})}
}

// tryLock takes every key or none. On success it returns the function
// that releases them; otherwise an error wrapping errdefs.ErrBusy that
// names the busy key.
func (l *inflight) tryLock(keys ...string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range keys {
		if _, busy := l.held[k]; busy {
			return nil, fmt.Errorf("an operation on %s is already in progress: %w", k, errdefs.ErrBusy)
		}
	}
	taken := make([]string, 0, len(keys))
	for _, k := range keys {
		if _, dup := l.held[k]; dup {
			continue // the same key twice in one call
		}
		l.held[k] = struct{}{}
		taken = append(taken, k)
	}
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, k := range taken {
			delete(l.held, k)
		}
	}, nil
}

func volumeKey(id string) string { return fmt.Sprintf("volume %q", id) }
func pathKey(p string) string    { return fmt.Sprintf("path %q", p) }
