//go:build !linux

package keyring

import (
	"fmt"

	"github.com/berth-csi/berth/internal/errdefs"
)

// ProcKeys lists the keys the caller may view.
const ProcKeys = "/proc/keys"

// List is not supported on this OS.
func List() ([]Key, error) { return nil, fmt.Errorf("kernel keys: %w", errdefs.ErrUnsupported) }

// FindKeyring is not supported on this OS.
func FindKeyring(string) (int, error) {
	return 0, fmt.Errorf("kernel keys: %w", errdefs.ErrUnsupported)
}

// Possessor acts on one keyring as its possessor.
type Possessor struct{}

// Possess is not supported on this OS.
func Possess(int, func(Possessor) error) error {
	return fmt.Errorf("kernel keys: %w", errdefs.ErrUnsupported)
}

// Search is not supported on this OS.
func (Possessor) Search(string, string) (int, error) { return 0, errdefs.ErrUnsupported }

// Read is not supported on this OS.
func (Possessor) Read(int) ([]byte, error) { return nil, errdefs.ErrUnsupported }

// Add is not supported on this OS.
func (Possessor) Add(string, string, []byte) (int, error) { return 0, errdefs.ErrUnsupported }

// AddKeyring is not supported on this OS.
func (Possessor) AddKeyring(string) (int, error) { return 0, errdefs.ErrUnsupported }

// Sub is not supported on this OS.
func (p Possessor) Sub(int) Possessor { return p }

// Unlink is not supported on this OS.
func (Possessor) Unlink(int) error { return errdefs.ErrUnsupported }

// Links is not supported on this OS.
func (Possessor) Links() ([]Key, error) { return nil, errdefs.ErrUnsupported }
