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
	// other is a second berth on the node: its own transport, the same
	// open-iscsi lock directory.
	other := testTransport(t, nil)
	other.db.walks = tr.db.walks
	unstick := stuckScanAttr(t, tr)
	p := path{Portal: Portal{Host: "10.0.0.1", Port: 3260, TPGT: -1}, IP: "10.0.0.1"}
	held, err := tr.lockPath(context.Background(), testIQN, p, "default")
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
	for _, by := range []*Transport{tr, other} {
		lctx, lcancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		if l, err := by.lockPath(lctx, testIQN, p, "default"); err == nil {
			l.Release()
			t.Fatalf("the portal was unlocked (for the berth of the scan: %t) while its scan still waited in the kernel", by == tr)
		}
		lcancel()
	}
	unstick()
	for _, by := range []*Transport{tr, other} {
		lctx, lcancel := context.WithTimeout(context.Background(), 5*time.Second)
		l, err := by.lockPath(lctx, testIQN, p, "default")
		lcancel()
		if err != nil {
			t.Fatalf("the portal stayed locked (for the berth of the scan: %t) after its scan ended: %v", by == tr, err)
		}
		l.Release()
	}
}
