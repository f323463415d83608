package fs

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
)

// cryptsetup runs cryptsetup with the passphrase on its standard input
// and names the sentinel of its exit code.
func cryptsetup(ctx context.Context, passphrase []byte, args ...string) error {
	if passphrase == nil {
		passphrase = []byte{}
	}
	_, err := runToolInput(ctx, passphrase, "cryptsetup", args...)
	var te *command.Error
	if errors.As(err, &te) && te.ExitCode >= 0 {
		te.Kind = cryptsetupKind(te.ExitCode)
	}
	return err
}

// LUKSFormat writes a new LUKS2 header to devPath with one key slot for
// passphrase. It overwrites what the device holds: call it only on a
// device Probe found blank (or one whose format berth began). The
// sector size is o.SectorSize, or chosen from the device (see
// luksSectorSize).
func LUKSFormat(ctx context.Context, devPath string, passphrase []byte, o LUKSOptions) error {
	if err := o.Validate(); err != nil {
		return fmt.Errorf("luksFormat %s: %w", devPath, err)
	}
	if len(passphrase) == 0 {
		return fmt.Errorf("luksFormat %s: empty passphrase: %w", devPath, errdefs.ErrInvalidArgument)
	}
	logical, size, err := blockGeometry(devPath)
	if err != nil {
		return fmt.Errorf("luksFormat %s: %w", devPath, err)
	}
	sector, err := luksSectorSize(o.SectorSize, logical, size)
	if err != nil {
		return fmt.Errorf("luksFormat %s: %w", devPath, err)
	}
	release, err := acquireHeavy(ctx, "luksFormat "+devPath)
	if err != nil {
		return err
	}
	defer release()
	return cryptsetup(ctx, passphrase, o.formatArgs(devPath, sector)...)
}

// LUKSOpen opens the LUKS2 device devPath as the dm-crypt mapping name,
// passing discards down to the device when allowDiscards is set (see
// openArgs). A passphrase no key slot takes gives an error wrapping
// errdefs.ErrPermissionDenied, with nothing opened.
func LUKSOpen(ctx context.Context, devPath, name string, passphrase []byte, allowDiscards bool) error {
	release, err := acquireHeavy(ctx, "open "+devPath)
	if err != nil {
		return err
	}
	defer release()
	return cryptsetup(ctx, passphrase, openArgs(devPath, name, allowDiscards)...)
}

// LUKSTestPassphrase checks that passphrase opens a key slot of the
// LUKS device devPath, without opening it.
func LUKSTestPassphrase(ctx context.Context, devPath string, passphrase []byte) error {
	release, err := acquireHeavy(ctx, "test passphrase of "+devPath)
	if err != nil {
		return err
	}
	defer release()
	return cryptsetup(ctx, passphrase, "open", "--test-passphrase", "--type", "luks2", "--key-file=-", "--", devPath)
}

// LUKSClose closes the dm-crypt mapping name (its buffers are flushed).
func LUKSClose(ctx context.Context, name string) error {
	return cryptsetup(ctx, nil, "close", "--", name)
}

// LUKSResize grows the mapping name to its device's size. A LUKS2
// mapping whose volume key is in the kernel keyring (cryptsetup's
// default) needs the passphrase to do so.
func LUKSResize(ctx context.Context, name string, passphrase []byte) error {
	return cryptsetup(ctx, passphrase, "resize", "--key-file=-", "--", name)
}

// blockGeometry returns the logical block size and the size in bytes of
// a block device.
func blockGeometry(devPath string) (logical int, size int64, err error) {
	if _, err := statBlockDevice(devPath); err != nil {
		return 0, 0, err
	}
	f, err := blockdev.Open(devPath, unix.O_RDONLY)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	if logical, err = blockdev.LogicalBlockSize(f); err != nil {
		return 0, 0, err
	}
	n, err := blockdev.Size(f)
	if err != nil {
		return 0, 0, err
	}
	return logical, n, nil
}

// CheckCryptsetup checks that cryptsetup is installed.
func CheckCryptsetup() error {
	if _, err := lookTool("cryptsetup"); err != nil {
		return fmt.Errorf("encrypted volumes need cryptsetup (Debian: cryptsetup-bin): %w", err)
	}
	return nil
}
