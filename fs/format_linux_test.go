package fs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/testutil"
)

// fakeTool puts an executable name first in the tool search path: it
// records its arguments in the returned file and exits 0.
func fakeTool(t *testing.T, name string) (calls string) {
	t.Helper()
	dir := t.TempDir()
	calls = filepath.Join(dir, name+".calls")
	script := "#!/bin/sh\necho \"$@\" >> " + calls + "\n"
	if err := os.WriteFile(filepath.Join(dir, name), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	old := toolDirs
	toolDirs = append([]string{dir}, old...)
	t.Cleanup(func() { toolDirs = old })
	return calls
}

// A device that answers the probe's reads with EIO (a failing disk, a
// dm-error target) is not blank: EnsureFilesystem fails with
// FailedPrecondition, naming the I/O error, and never runs mkfs.
func TestHostEnsureFilesystemReadEIO(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid")
	dev, file := newLoop(t, 64*mib)
	calls := fakeTool(t, "mkfs.ext4")
	withReadAt(t, func(*os.File, []byte, int64) (int, error) { return 0, unix.EIO })
	before := hashFile(t, file)
	formatted, err := EnsureFilesystem(context.Background(), dev, Ext4, MkfsOptions{})
	if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) || !errors.Is(err, unix.EIO) {
		t.Errorf("EnsureFilesystem of a device that answers EIO = %v, %v; want FailedPrecondition wrapping EIO", formatted, err)
	}
	if b, err := os.ReadFile(calls); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mkfs.ext4 ran: %q (%v)", b, err)
	}
	if hashFile(t, file) != before {
		t.Error("device bytes changed")
	}
	t.Logf("EnsureFilesystem: %v", err)
}
