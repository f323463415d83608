//go:build !linux

package devices

import (
	"context"
	"fmt"
	"os"
	"runtime"

	"github.com/berth-csi/berth/internal/errdefs"
)

var errUnsupported = fmt.Errorf("block devices on %s: %w", runtime.GOOS, errdefs.ErrUnsupported)

type ueventConn struct{}

func (*ueventConn) sendMarker(uint64) error { return errUnsupported }

func isQueueFull(error) bool { return false }

func nodeMatches(*Device) bool { return false }

// NewListener is only supported on Linux.
func NewListener(...ListenerOption) (*Listener, error) { return nil, errUnsupported }

// Close stops the listener.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		l.stop(ErrListenerClosed)
		close(l.done)
	})
	return nil
}

// Verify is only supported on Linux.
func (d *Device) Verify() error { return errUnsupported }

// AttachLoopFile is only supported on Linux.
func AttachLoopFile(context.Context, *Listener, *os.File, string, bool) (*Device, error) {
	return nil, errUnsupported
}

// FindLoop is only supported on Linux.
func (Roots) FindLoop(string) (*Device, error) { return nil, errUnsupported }

// FindLoopOf is only supported on Linux.
func (Roots) FindLoopOf(*os.File) (*Device, error) { return nil, errUnsupported }

// FindLoopRef is only supported on Linux.
func (Roots) FindLoopRef(LoopRef) (*Device, error) { return nil, errUnsupported }

// MarkedLoop is a loop device berth attached (Linux only).
type MarkedLoop struct {
	Device *Device
	File   string
}

// MarkedLoops is only supported on Linux.
func (Roots) MarkedLoops() ([]MarkedLoop, error) { return nil, errUnsupported }

// FindDeletedLoop is only supported on Linux.
func (Roots) FindDeletedLoop(string) (*Device, error) { return nil, errUnsupported }

// DetachLoop is only supported on Linux.
func DetachLoop(*Device) error { return errUnsupported }

// DetachLoopContext is only supported on Linux.
func DetachLoopContext(context.Context, *Listener, *Device) error { return errUnsupported }

// RefreshLoopCapacity is only supported on Linux.
func RefreshLoopCapacity(context.Context, *Device) (int64, error) { return 0, errUnsupported }

// MultipathPaths is only supported on Linux.
func MultipathPaths(*Device) ([]PathState, error) { return nil, errUnsupported }

// FlushDevice is only supported on Linux.
func FlushDevice(context.Context, *Device) error { return errUnsupported }

// RemoveSCSIDevice is only supported on Linux.
func RemoveSCSIDevice(context.Context, *Listener, *Device) error { return errUnsupported }

// RemoveMultipathMap is only supported on Linux.
func RemoveMultipathMap(context.Context, *Listener, *Device) error { return errUnsupported }

// SetQueueIfNoPath is only supported on Linux.
func SetQueueIfNoPath(*Device, bool) error { return errUnsupported }

// InUse is only supported on Linux.
func InUse(*Device) error { return errUnsupported }

// CheckDeviceMapper is only supported on Linux.
func (Roots) CheckDeviceMapper() error { return errUnsupported }

// LoopBackingFile is only supported on Linux.
func LoopBackingFile(*Device) (*os.File, int64, error) { return nil, 0, errUnsupported }

// ReservationReadable is only supported on Linux.
func ReservationReadable(*Device) bool { return false }

// PR is only supported on Linux.
type PR struct{}

// OpenPR is only supported on Linux.
func OpenPR(*Device) (*PR, error) { return nil, errUnsupported }

// Close is only supported on Linux.
func (*PR) Close() error { return errUnsupported }

// Register is only supported on Linux.
func (*PR) Register(uint64, uint64, bool) error { return errUnsupported }

// Reserve is only supported on Linux.
func (*PR) Reserve(uint64, PRType) error { return errUnsupported }

// Release is only supported on Linux.
func (*PR) Release(uint64, PRType) error { return errUnsupported }

// Preempt is only supported on Linux.
func (*PR) Preempt(uint64, uint64, PRType, bool) error { return errUnsupported }

// ReadReservation is only supported on Linux.
func (*PR) ReadReservation() (Reservation, error) { return Reservation{}, errUnsupported }
