package fs

import (
	"errors"
	"fmt"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
)

// e2fsck exit status bits (e2fsck(8)); several may be set at once.
const (
	fsckOK                 = 0
	fsckCorrected          = 1   // errors corrected
	fsckCorrectedReboot    = 2   // errors corrected, system should be rebooted
	fsckUncorrected        = 4   // errors left uncorrected
	fsckOperationalError   = 8   // operational error
	fsckUsageError         = 16  // usage or syntax error
	fsckCancelled          = 32  // cancelled by user request
	fsckSharedLibraryError = 128 // shared library error
)

// fsckResult interprets the outcome of an e2fsck -p run.
func fsckResult(devPath string, err error) error {
	if err == nil {
		return nil
	}
	var te *command.Error
	if !errors.As(err, &te) || te.ExitCode < 0 {
		return fmt.Errorf("fsck %s: %w", devPath, err)
	}
	code := te.ExitCode
	switch {
	case code&^(fsckCorrected|fsckCorrectedReboot) == fsckOK:
		// Fixed; a reboot request concerns only the root filesystem.
		return nil
	case code&fsckUncorrected != 0 && code&^(fsckCorrected|fsckCorrectedReboot|fsckUncorrected) == 0:
		te.Kind = errdefs.ErrFailedPrecondition
		return fmt.Errorf("fsck %s: filesystem has errors e2fsck -p could not fix; run e2fsck by hand on the node: %w", devPath, te)
	case code&fsckOperationalError != 0:
		return fmt.Errorf("fsck %s: e2fsck operational error: %w", devPath, te)
	case code&fsckUsageError != 0:
		return fmt.Errorf("fsck %s: e2fsck usage error: %w", devPath, te)
	case code&fsckCancelled != 0:
		return fmt.Errorf("fsck %s: e2fsck cancelled: %w", devPath, te)
	case code&fsckSharedLibraryError != 0:
		return fmt.Errorf("fsck %s: e2fsck shared library error: %w", devPath, te)
	}
	return fmt.Errorf("fsck %s: %w", devPath, te)
}
