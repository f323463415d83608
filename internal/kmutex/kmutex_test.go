package kmutex

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestSameKeySerializes(t *testing.T) {
	var k KeyedMutex
	var inside, most atomic.Int32
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			unlock, err := k.Lock(context.Background(), "a")
			if err != nil {
				t.Error(err)
				return
			}
			n := inside.Add(1)
			for {
				m := most.Load()
				if n <= m || most.CompareAndSwap(m, n) {
					break
				}
			}
			time.Sleep(time.Millisecond)
			inside.Add(-1)
			unlock()
		}()
	}
	wg.Wait()
	if most.Load() != 1 {
		t.Fatalf("%d holders of one key at once", most.Load())
	}
	if n := k.len(); n != 0 {
		t.Fatalf("%d keys left after every unlock", n)
	}
}

func TestOtherKeysRunInParallel(t *testing.T) {
	var k KeyedMutex
	unlockA, err := k.Lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	defer unlockA()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	unlockB, err := k.Lock(ctx, "b")
	if err != nil {
		t.Fatalf("key b blocked by a holder of key a: %v", err)
	}
	unlockB()
}

func TestWaitEndsWithContext(t *testing.T) {
	var k KeyedMutex
	unlock, err := k.Lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := k.Lock(ctx, "a"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Lock of a held key with an ending context: %v", err)
	}
	unlock()
	unlock() // a second unlock is harmless
	if n := k.len(); n != 0 {
		t.Fatalf("%d keys left after the waiter gave up and the holder unlocked", n)
	}
	again, err := k.Lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	again()
}

// len reports how many keys are held or waited for.
func (k *KeyedMutex) len() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.m)
}

func TestHeldReleaseAndRetake(t *testing.T) {
	var k KeyedMutex
	h, err := k.Hold(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Retake(context.Background()); err != nil {
		t.Fatalf("Retake of a held key: %v", err)
	}
	h.Release()
	h.Release() // a deferred Release after one made mid-call
	other, err := k.Hold(context.Background(), "a")
	if err != nil {
		t.Fatalf("key still locked after Release: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := h.Retake(ctx); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "wait for another operation on a") {
		t.Fatalf("Retake of a key another holds, with an ending context: %v", err)
	}
	other.Release()
	if err := h.Retake(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.Release()
	if n := k.len(); n != 0 {
		t.Fatalf("%d keys left after every release", n)
	}
	var zero Held
	zero.Release()
	if err := zero.Retake(context.Background()); err == nil {
		t.Fatal("Retake of a zero Held succeeded")
	}
}

func TestHeldHandOff(t *testing.T) {
	var k KeyedMutex
	h, err := k.Hold(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	unlock := h.HandOff()
	h.Release()
	if err := h.Retake(context.Background()); err == nil {
		t.Error("Retake after HandOff succeeded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if u, err := k.Lock(ctx, "a"); err == nil {
		u()
		t.Fatal("the key was free after HandOff and Release")
	}
	unlock()
	unlock()
	u, err := k.Lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	u()
	if n := k.len(); n != 0 {
		t.Fatalf("%d keys left", n)
	}
	// A released key hands off nothing.
	h2, _ := k.Hold(context.Background(), "b")
	h2.Release()
	h2.HandOff()()
	if n := k.len(); n != 0 {
		t.Fatalf("%d keys left", n)
	}
}
