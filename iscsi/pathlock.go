package iscsi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	"github.com/berth-csi/berth/internal/kmutex"
	"github.com/berth-csi/berth/internal/lockfile"
)

// pathLock orders the work on one target's session through one portal
// and interface: login, scan, disk removal, the check that the session
// has no LUN left and the logout that follows it. A session is the
// node's, not one berth's: two berths on the node (each with a state
// directory of its own) may stage LUNs of one target through one portal,
// and one's logout between the other's finding the session and scanning
// its LUN into it would take the other's disk away. So the lock is the
// path's key inside berth and, for the berths of the node, an flock in
// open-iscsi's lock directory (see recordWalks.lockInContext).
//
// Like kmutex.Held, it may be let go mid-call (Release), taken again
// (Retake) and handed to a step that outlives the call (HandOff). It
// belongs to the call that took it.
type pathLock struct {
	held  *kmutex.Held
	walks *recordWalks // nil: inside berth only (tests of one transport)
	name  string       // the lock file's name in walks' directory
	file  *lockfile.Lock
}

// lockPath takes the lock of target's sessions through p on iface,
// waiting within ctx.
func (t *Transport) lockPath(ctx context.Context, target string, p path, iface string) (*pathLock, error) {
	key := p.key(target, iface)
	held, err := t.locks.Hold(ctx, key)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(key))
	l := &pathLock{held: held, walks: t.db.walks, name: "berth.path." + hex.EncodeToString(sum[:16])}
	if err := l.lockFile(ctx); err != nil {
		held.Release()
		return nil, err
	}
	return l, nil
}

func (l *pathLock) lockFile(ctx context.Context) error {
	if l.walks == nil {
		return nil
	}
	f, err := l.walks.lockInContext(ctx, l.name)
	if err != nil {
		return fmt.Errorf("lock the session across the berths of the node: %w", err)
	}
	l.file = f
	return nil
}

// Release lets the lock go if it is held.
func (l *pathLock) Release() {
	if l.file != nil {
		l.file.Close()
		l.file = nil
	}
	l.held.Release()
}

// Retake takes the lock again after Release; a lock still held is left
// as it is.
func (l *pathLock) Retake(ctx context.Context) error {
	if err := l.held.Retake(ctx); err != nil {
		return err
	}
	if l.file != nil {
		return nil
	}
	if err := l.lockFile(ctx); err != nil {
		l.held.Release()
		return err
	}
	return nil
}

// HandOff passes the lock, if held, to whoever calls the returned
// function (see kmutex.Held.HandOff).
func (l *pathLock) HandOff() (unlock func()) {
	f := l.file
	l.file = nil
	unlockKey := l.held.HandOff()
	return func() {
		if f != nil {
			f.Close()
		}
		unlockKey()
	}
}

// removeFile deletes the lock's file, once the session is logged out and
// its record deleted, and lets the lock go: a session's lock file lasts
// as long as the session (the lock directory is on tmpfs, and the
// targets of a node come and go). A berth waiting on the file meanwhile
// takes the lock on the one the name gives it next (lockfile.WaitContext).
func (l *pathLock) removeFile() error {
	var err error
	if l.file != nil {
		err = l.file.Remove()
		l.file = nil
	}
	l.held.Release()
	return err
}
