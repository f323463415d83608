package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/berth-csi/berth/internal/testutil"
)

// dirtyCopy formats a fresh image with fsType, writes files on it while
// mounted and copies the image then, as a snapshot of a volume in use is
// taken: the copy's journal holds transactions that were never written
// in place. It returns the copy and how many files were written.
func dirtyCopy(t *testing.T, fsType string, size int64) (string, int) {
	t.Helper()
	_, file, mnt := mounted(t, fsType, size)
	const files = 40
	for i := range files {
		if err := os.WriteFile(filepath.Join(mnt, fmt.Sprintf("f%d", i)), []byte("data"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// The journal's commits reach the device; the metadata in place
	// stays behind until a checkpoint, which a copy taken now lacks.
	f, err := os.Open(filepath.Join(mnt, "f0"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	cp := filepath.Join(t.TempDir(), "snapshot.img")
	if err := os.WriteFile(cp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return cp, files
}

// A read-only mount of a filesystem whose journal needs replaying, on a
// device that cannot be written, is refused with an error that matches
// ErrRecoveryNeedsWrite; the same mount with noload (ext4) or
// norecovery (xfs) works and changes nothing on the device.
func TestHostDirtyJournalReadOnlyDevice(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	for _, tc := range []struct {
		fsType, opt string
		size        int64
	}{{Ext4, "noload", 64 * mib}, {XFS, "norecovery", 300 * mib}} {
		t.Run(tc.fsType, func(t *testing.T) {
			cp, files := dirtyCopy(t, tc.fsType, tc.size)
			dev := attachLoop(t, cp)
			if err := SetDeviceReadOnly(dev, true); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = SetDeviceReadOnly(dev, false) })
			before := hashFile(t, cp)
			mnt := t.TempDir()
			data := ""
			if tc.fsType == XFS {
				data = "nouuid"
			}
			err := Mount(dev, mnt, tc.fsType, MS_RDONLY, data)
			if err == nil {
				Unmount(mnt)
				t.Fatalf("%s mounted read-only on a read-only device: the copy's journal needed no recovery, so the test proves nothing", tc.fsType)
			}
			if !errors.Is(err, ErrRecoveryNeedsWrite) {
				t.Fatalf("read-only mount of a dirty %s on a read-only device: %v, want ErrRecoveryNeedsWrite", tc.fsType, err)
			}
			// A writable mount refused for the read-only device is not
			// a journal that needs recovery.
			if err := Mount(dev, mnt, tc.fsType, 0, data); err == nil || errors.Is(err, ErrRecoveryNeedsWrite) {
				if err == nil {
					Unmount(mnt)
				}
				t.Errorf("read-write mount on a read-only device: %v, want an error that is not ErrRecoveryNeedsWrite", err)
			}
			if data != "" {
				data += ","
			}
			if err := Mount(dev, mnt, tc.fsType, MS_RDONLY, data+tc.opt); err != nil {
				t.Fatalf("mount with %s: %v", tc.opt, err)
			}
			entries, err := os.ReadDir(mnt)
			if err := Unmount(mnt); err != nil {
				t.Error(err)
			}
			// ext4's journal commits carried the new files' blocks, which
			// noload leaves out, but the directory reads; xfs's log did
			// too. What is shown is the filesystem as last checkpointed.
			if err != nil {
				t.Errorf("mounted with %s: read the root: %v", tc.opt, err)
			}
			t.Logf("%s with %s: %d of the %d files written before the copy", tc.fsType, tc.opt, len(entries), files)
			if hashFile(t, cp) != before {
				t.Error("the read-only device's image changed")
			}
		})
	}
}
