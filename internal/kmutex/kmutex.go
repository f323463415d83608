// Package kmutex provides a mutex per key: work on one key (a subsystem
// NQN, a portal, a backing file) is serialized while work on other keys
// runs in parallel, and waiting for a key ends with the caller's context.
package kmutex

import (
	"context"
	"sync"
)

// KeyedMutex is a set of mutexes indexed by string. The zero value is
// ready to use. Keys nobody holds or waits for take no memory.
type KeyedMutex struct {
	mu sync.Mutex
	m  map[string]*entry
}

type entry struct {
	ch   chan struct{} // holds one token while the key is locked
	refs int           // holders and waiters
}

// Lock locks key, waiting while another caller holds it. It returns the
// function that unlocks it, or ctx's error if ctx ends first.
func (k *KeyedMutex) Lock(ctx context.Context, key string) (unlock func(), err error) {
	k.mu.Lock()
	if k.m == nil {
		k.m = make(map[string]*entry)
	}
	e := k.m[key]
	if e == nil {
		e = &entry{ch: make(chan struct{}, 1)}
		k.m[key] = e
	}
	e.refs++
	k.mu.Unlock()

	release := func() {
		k.mu.Lock()
		if e.refs--; e.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
	select {
	case e.ch <- struct{}{}:
		var once sync.Once
		return func() { once.Do(func() { <-e.ch; release() }) }, nil
	case <-ctx.Done():
		release()
		return nil, ctx.Err()
	}
}
