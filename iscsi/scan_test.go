package iscsi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// stuckScanAttr makes the scan attribute of SCSI host 3 a FIFO: a write
// to it waits until someone reads, as a scan waits for a target that
// does not answer its INQUIRY or REPORT LUNS. unstick lets it end.
func stuckScanAttr(t *testing.T, tr *Transport) (unstick func()) {
	t.Helper()
	attr := tr.sys.root.Path("class", "scsi_host", "host3", "scan")
	if err := os.MkdirAll(filepath.Dir(attr), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(attr, 0o600); err != nil {
		t.Fatal(err)
	}
	var done bool
	unstick = func() {
		if done {
			return
		}
		done = true
		f, err := os.OpenFile(attr, os.O_RDONLY, 0)
		if err != nil {
			t.Error(err)
			return
		}
		f.Close()
	}
	t.Cleanup(unstick)
	return unstick
}

// TestScanEndsWithContext: a LUN scan through a session whose target no
// longer answers ends with the attach's deadline (UNAVAILABLE), not when
// the kernel gives up; the portal stays locked until the scan's write has
// ended, so that no other scan or logout of the session runs beside it.
func TestScanEndsWithContext(t *testing.T) {
	tr := testTransport(t, nil)
	unstick := stuckScanAttr(t, tr)
	key := "iqn.test,10.0.0.1:3260,default"
	held, err := tr.locks.Hold(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = tr.scan(ctx, held, &Session{ID: 1, Host: 3, TargetID: 0}, 0)
	if took := time.Since(start); !errors.Is(err, errdefs.ErrUnavailable) || took > 2*time.Second {
		t.Fatalf("scan through a stuck host: %v after %v, want Unavailable at the 300 ms deadline", err, took)
	}
	held.Release() // the caller's deferred Release: the scan has the lock now
	lctx, lcancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer lcancel()
	if unlock, err := tr.locks.Lock(lctx, key); err == nil {
		unlock()
		t.Fatal("the portal was unlocked while its scan still waited in the kernel")
	}
	unstick()
	lctx, lcancel = context.WithTimeout(context.Background(), 5*time.Second)
	defer lcancel()
	unlock, err := tr.locks.Lock(lctx, key)
	if err != nil {
		t.Fatalf("the portal stayed locked after its scan ended: %v", err)
	}
	unlock()
}
