package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/testutil"
)

// hostUnderTest is one implementation of hostFS with what the contract
// cases need to set it up: the real one (package fs, on loop devices) and
// the fake the scenario tests drive. Both answer the same cases the same
// way, so that a scenario test on the fake shows what the node does.
type hostUnderTest struct {
	host hostFS
	// blank returns a device that holds nothing, its device numbers and
	// its size.
	blank func(t *testing.T) (path string, major, minor uint32, size int64)
	// foreign makes dev hold data that is no filesystem.
	foreign func(t *testing.T, dev string)
}

func realHostUnderTest(t *testing.T) hostUnderTest {
	testutil.RequireRoot(t, "loop devices, mkfs, mount", "losetup", "mkfs.ext4")
	return hostUnderTest{
		host: realFS{},
		blank: func(t *testing.T) (string, uint32, uint32, int64) {
			const size = 64 << 20
			img := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(img, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, size); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command("losetup", "--find", "--show", "--", img).Output()
			if err != nil {
				t.Fatalf("losetup: %v", err)
			}
			dev := strings.TrimSpace(string(out))
			t.Cleanup(func() { exec.Command("losetup", "--detach", dev).Run() })
			var st unix.Stat_t
			if err := unix.Stat(dev, &st); err != nil {
				t.Fatal(err)
			}
			return dev, unix.Major(st.Rdev), unix.Minor(st.Rdev), size
		},
		foreign: func(t *testing.T, dev string) {
			f, err := os.OpenFile(dev, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteAt([]byte("a database page, not a filesystem"), 0); err != nil {
				t.Fatal(err)
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
		},
	}
}

func fakeHostUnderTest(t *testing.T) hostUnderTest {
	f := newFakeFS()
	f.devDir = t.TempDir()
	n := uint32(0)
	return hostUnderTest{
		host: f,
		blank: func(t *testing.T) (string, uint32, uint32, int64) {
			n++
			return filepath.Join(f.devDir, fmt.Sprintf("fake7-%d", n)), 7, n, 1 << 20
		},
		foreign: func(_ *testing.T, dev string) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.content[dev] = "database"
		},
	}
}

// TestHostFSContract runs the fake host layer and the real one through the
// same cases: a fake that answers otherwise than package fs makes the
// scenario tests show a node that does not exist.
func TestHostFSContract(t *testing.T) {
	for _, impl := range []struct {
		name string
		make func(*testing.T) hostUnderTest
	}{{"fake", fakeHostUnderTest}, {"real", realHostUnderTest}} {
		t.Run(impl.name, func(t *testing.T) {
			h := impl.make(t)
			ctx := context.Background()
			noHook := func() error { return nil }

			t.Run("FormatsOnceAndKeepsTheUUID", func(t *testing.T) {
				dev, _, _, _ := h.blank(t)
				formatted, err := h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, noHook)
				if !formatted || err != nil {
					t.Fatalf("EnsureFilesystem(blank) = %v, %v; want true, nil", formatted, err)
				}
				uuid, err := h.host.FilesystemUUID(dev, "ext4")
				if uuid == "" || err != nil {
					t.Fatalf("FilesystemUUID = %q, %v", uuid, err)
				}
				formatted, err = h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, noHook)
				if formatted || err != nil {
					t.Errorf("EnsureFilesystem(ext4 already) = %v, %v; want false, nil", formatted, err)
				}
				if again, err := h.host.FilesystemUUID(dev, "ext4"); again != uuid || err != nil {
					t.Errorf("FilesystemUUID after the second EnsureFilesystem = %q, %v; want %q", again, err, uuid)
				}
				if u, err := h.host.FilesystemUUID(dev, "xfs"); err == nil {
					t.Errorf("FilesystemUUID(ext4 device, xfs) = %q, nil; want an error", u)
				}
			})

			t.Run("RefusesAnotherFilesystem", func(t *testing.T) {
				dev, _, _, _ := h.blank(t)
				if _, err := h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, noHook); err != nil {
					t.Fatal(err)
				}
				uuid, _ := h.host.FilesystemUUID(dev, "ext4")
				called := false
				_, err := h.host.EnsureFilesystem(ctx, dev, "xfs", fs.MkfsParams{}, nil, func() error { called = true; return nil })
				if !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Errorf("EnsureFilesystem(ext4 device, xfs) = %v; want ErrFailedPrecondition", err)
				}
				if called {
					t.Error("the hook before mkfs ran for a device holding ext4")
				}
				if after, err := h.host.FilesystemUUID(dev, "ext4"); after != uuid || err != nil {
					t.Errorf("ext4 after the refusal: UUID %q, %v; want %q", after, err, uuid)
				}
			})

			t.Run("RefusesForeignData", func(t *testing.T) {
				dev, _, _, _ := h.blank(t)
				h.foreign(t, dev)
				called := false
				formatted, err := h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, func() error { called = true; return nil })
				if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Errorf("EnsureFilesystem(foreign data) = %v, %v; want false, ErrFailedPrecondition", formatted, err)
				}
				if called {
					t.Error("the hook before mkfs ran for a device holding data")
				}
			})

			t.Run("HookErrorStopsTheFormat", func(t *testing.T) {
				dev, _, _, _ := h.blank(t)
				stop := errors.New("the record of the format could not be written")
				formatted, err := h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, func() error { return stop })
				if formatted || !errors.Is(err, stop) {
					t.Fatalf("EnsureFilesystem(hook fails) = %v, %v; want false and the hook's error", formatted, err)
				}
				if u, err := h.host.FilesystemUUID(dev, "ext4"); err == nil {
					t.Errorf("the device has an ext4 (UUID %q) after the hook stopped the format", u)
				}
				if formatted, err := h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, noHook); !formatted || err != nil {
					t.Errorf("EnsureFilesystem after a stopped format = %v, %v; want true, nil (still blank)", formatted, err)
				}
			})

			t.Run("MountCycle", func(t *testing.T) {
				dev, major, minor, _ := h.blank(t)
				if _, err := h.host.EnsureFilesystem(ctx, dev, "ext4", fs.MkfsParams{}, nil, noHook); err != nil {
					t.Fatal(err)
				}
				parent := t.TempDir()
				target := filepath.Join(parent, "staging")
				if err := os.Mkdir(target, 0o750); err != nil {
					t.Fatal(err)
				}
				th, err := fs.OpenPath(target)
				if err != nil {
					t.Fatal(err)
				}
				defer th.Close()
				if _, err := h.host.MountInfo(th); !errors.Is(err, errdefs.ErrNotFound) {
					t.Errorf("MountInfo(empty directory) = %v; want ErrNotFound", err)
				}
				if err := h.host.Mount(dev, th, "ext4", 0, ""); err != nil {
					t.Fatalf("Mount: %v", err)
				}
				ph, err := fs.OpenPath(parent)
				if err != nil {
					t.Fatal(err)
				}
				defer ph.Close()
				t.Cleanup(func() { h.host.Unmount(ph, "staging", nil) })

				// The mount's root, not the directory under it; closed
				// before the unmount, which any open descriptor of the
				// mount (O_PATH too) makes busy.
				mh, err := fs.OpenPath(target)
				if err != nil {
					t.Fatal(err)
				}
				m, err := h.host.MountInfo(mh)
				mh.Close()
				if err != nil {
					t.Fatalf("MountInfo(mounted) = %v", err)
				}
				if m.FSType != "ext4" || uint32(m.Major) != major || uint32(m.Minor) != minor || m.Ino != fakeRootIno || m.FSError != nil {
					t.Errorf("MountInfo = %+v; want ext4 of %d:%d, root inode %d, no error", m, major, minor, fakeRootIno)
				}
				points, err := h.host.MountPoints(major, minor)
				if err != nil || !slices.Contains(points, target) {
					t.Errorf("MountPoints(%d:%d) = %q, %v; want it to list %s", major, minor, points, err, target)
				}

				refused := errors.New("not this volume's filesystem")
				var seen mountEntry
				err = h.host.Unmount(ph, "staging", func(e mountEntry) error { seen = e; return refused })
				if !errors.Is(err, refused) {
					t.Errorf("Unmount with a refusing check = %v; want its error", err)
				}
				if seen.FSType != "ext4" || uint32(seen.Major) != major || uint32(seen.Minor) != minor {
					t.Errorf("Unmount's check saw %+v; want the ext4 of %d:%d", seen, major, minor)
				}
				if points, _ := h.host.MountPoints(major, minor); !slices.Contains(points, target) {
					t.Errorf("a refused Unmount unmounted %s", target)
				}
				if err := h.host.Unmount(ph, "staging", nil); err != nil {
					t.Fatalf("Unmount: %v", err)
				}
				if points, err := h.host.MountPoints(major, minor); len(points) != 0 || err != nil {
					t.Errorf("MountPoints after Unmount = %q, %v; want none", points, err)
				}
				if err := h.host.Unmount(ph, "staging", nil); err != nil {
					t.Errorf("Unmount of nothing mounted = %v; want nil", err)
				}
			})

			t.Run("ReadOnlyFlagAndSize", func(t *testing.T) {
				dev, _, _, size := h.blank(t)
				if n, err := h.host.BlockDeviceSize(dev); n != size || err != nil {
					t.Errorf("BlockDeviceSize = %d, %v; want %d", n, err, size)
				}
				for _, ro := range []bool{true, false} {
					if err := h.host.SetDeviceReadOnly(dev, ro); err != nil {
						t.Fatalf("SetDeviceReadOnly(%v): %v", ro, err)
					}
					if got, err := h.host.DeviceReadOnly(dev); got != ro || err != nil {
						t.Errorf("DeviceReadOnly after SetDeviceReadOnly(%v) = %v, %v", ro, got, err)
					}
				}
			})

			t.Run("MountOptions", func(t *testing.T) {
				if !slices.Contains(h.host.SupportedFsTypes(), "ext4") || !slices.Contains(h.host.SupportedFsTypes(), "xfs") {
					t.Errorf("SupportedFsTypes = %q; want ext4 and xfs", h.host.SupportedFsTypes())
				}
				if _, _, err := h.host.ParseMountOptions([]string{"errors=panic"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
					t.Errorf("ParseMountOptions(errors=panic) = %v; want ErrInvalidArgument", err)
				}
				if _, _, err := h.host.ParseMountOptions([]string{"noatime"}); err != nil {
					t.Errorf("ParseMountOptions(noatime) = %v", err)
				}
			})
		})
	}
}
