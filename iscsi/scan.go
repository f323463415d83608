package iscsi

import (
	"context"
	"errors"
	"fmt"

	"github.com/berth-csi/berth/internal/errdefs"
)

// The kernel completes a write to a SCSI host's scan attribute or a
// disk's rescan attribute only once the target has answered the commands
// it sends (INQUIRY, REPORT LUNS, READ CAPACITY, the VPD pages), or once
// its command timeouts and error recovery gave up: minutes with a target
// that stopped answering. Such a write cannot be interrupted, so berth
// waits for it only until the request's deadline; the write goes on in
// a goroutine of its own and keeps the portal's lock (see pathLock) until
// it ends, so that no other scan or logout of that session, and no
// removal started under the lock, runs beside it, and a retry waits for
// the lock instead of adding writes.

// errStillWaiting is the error of a scan or rescan left waiting in the
// kernel at the request's deadline. Its portal lock went with it: the
// caller must not take the lock again (an attach's undo).
var errStillWaiting = errors.New("still waiting in the kernel for the target to answer")

// scan asks the kernel to probe LUN lun of the session's target (see
// sysfs.Scan), bounded by ctx as above. held is the portal's lock.
func (t *Transport) scan(ctx context.Context, held *pathLock, sess *Session, lun int) error {
	return untilDeadline(ctx, held, fmt.Sprintf("scan LUN %d of SCSI host %d (session %d)", lun, sess.Host, sess.ID), func() error {
		return t.sys.Scan(sess, lun)
	})
}

// rescan makes the kernel read a disk's capacity and identification again
// (see sysfs.Rescan), bounded by ctx as above. held is the portal's lock.
func (t *Transport) rescan(ctx context.Context, held *pathLock, h HCTL) error {
	return untilDeadline(ctx, held, "rescan SCSI device "+h.String(), func() error {
		return t.sys.Rescan(h)
	})
}

// untilDeadline runs write and waits for it until ctx ends; then it hands
// held to the write, which lets it go when it returns, and answers
// UNAVAILABLE.
func untilDeadline(ctx context.Context, held *pathLock, what string, write func() error) error {
	done := make(chan error, 1)
	go func() { done <- write() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	unlock := held.HandOff()
	go func() {
		<-done
		unlock()
	}()
	return fmt.Errorf("%s: %w at the request's deadline (check the target and the network path to it); the kernel goes on, and the portal's next attach or detach waits for it: %w",
		what, errStillWaiting, errors.Join(errdefs.ErrUnavailable, ctx.Err()))
}
