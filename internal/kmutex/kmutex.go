// Package kmutex provides a mutex per key: work on one key (a subsystem
// NQN, a portal, a backing file) is serialized while work on other keys
// runs in parallel, and waiting for a key ends with the caller's context.
package kmutex

import (
	"context"
	"errors"
	"fmt"
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

// Held is one key of a KeyedMutex locked by one call, which may let it
// go in the middle (while it waits for something that needs no lock) and
// take it again (to undo its work under the lock). It belongs to the
// call that took it: it is not for concurrent use. Hold makes it; the
// zero value holds nothing, and its Retake fails.
type Held struct {
	k      *KeyedMutex
	key    string
	unlock func() // nil while released
	handed bool   // HandOff gave the key away
}

// Hold locks key as Lock does and returns it held. A wait that ctx ends
// first fails with an error that says what it waited for.
func (k *KeyedMutex) Hold(ctx context.Context, key string) (*Held, error) {
	h := &Held{k: k, key: key}
	if err := h.Retake(ctx); err != nil {
		return nil, err
	}
	return h, nil
}

// Release unlocks the key if it is held; releasing a released key does
// nothing, so that a deferred Release follows one made mid-call.
func (h *Held) Release() {
	if h.unlock != nil {
		h.unlock()
		h.unlock = nil
	}
}

// HandOff passes the key, if held, to whoever calls the returned
// function (a step that goes on after the call returned, in a goroutine
// of its own): Release does nothing after it, and Retake fails, since the
// key is no longer the call's to take. The returned function unlocks at
// most once.
func (h *Held) HandOff() (unlock func()) {
	unlock = h.unlock
	h.unlock, h.handed = nil, true
	if unlock == nil {
		return func() {}
	}
	return unlock
}

// Retake locks the key again if Release let it go, waiting as Hold does;
// a key still held is left as it is.
func (h *Held) Retake(ctx context.Context) error {
	if h.unlock != nil {
		return nil
	}
	if h.k == nil {
		return errors.New("retake a key no Hold took")
	}
	if h.handed {
		return fmt.Errorf("retake %s: handed off to a step still running", h.key)
	}
	unlock, err := h.k.Lock(ctx, h.key)
	if err != nil {
		return fmt.Errorf("wait for another operation on %s: %w", h.key, err)
	}
	h.unlock = unlock
	return nil
}
