//go:build !linux

package nvmeof

import (
	"context"
	"errors"
	"fmt"

	"github.com/berth-csi/berth/internal/errdefs"
)

// DefaultFabricsDevice is the kernel's fabrics connect interface.
const DefaultFabricsDevice = "/dev/nvme-fabrics"

var errDuplicate = errors.New("a controller with these options already exists")

var errRefused = errors.New("connection refused")

var errNoHandshake = errors.New("no TLS handshake daemon")

var errTimedOut = errors.New("timed out")

func fabricsOptions(string) (string, error) { return "", errNotLinux }

var errNotLinux = fmt.Errorf("NVMe over Fabrics needs Linux: %w", errdefs.ErrUnsupported)

func fabricsConnect(context.Context, string, string) (int, error)             { return 0, errNotLinux }
func (sysTree) deleteController(string, string, func(*Controller) bool) error { return errNotLinux }
func (sysTree) rescanController(string) error                                 { return errNotLinux }
func flushDevice(string) error                                                { return errNotLinux }
func openedExclusively(string) bool                                           { return false }

func identifyNamespaceSize(string, string, uint32) (int64, error) { return 0, errNotLinux }
