package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

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
	testutil.RequireRoot(t, "loop devices, mkfs, mount", "losetup", "mkfs.ext4", "e2fsck", "resize2fs")
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
			return filepath.Join(f.devDir, fmt.Sprintf("fake7-%d", n)), 7, n, fakeDevSize
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
// scenario tests show a node that does not exist. Every method of hostFS
// is called by some case, which the run checks, so that a method added to
// the interface without a case fails here.
func TestHostFSContract(t *testing.T) {
	for _, impl := range []struct {
		name string
		make func(*testing.T) hostUnderTest
	}{{"fake", fakeHostUnderTest}, {"real", realHostUnderTest}} {
		t.Run(impl.name, func(t *testing.T) {
			h := impl.make(t)
			rec := &recordingFS{hostFS: h.host, called: make(map[string]bool)}
			h.host = rec
			ran := 0
			for _, c := range hostFSContract {
				t.Run(c.name, func(t *testing.T) {
					ran++
					c.run(t, h)
				})
			}
			if ran < len(hostFSContract) {
				return // -run chose some cases
			}
			for _, m := range hostFSMethods() {
				if !rec.called[m] {
					t.Errorf("hostFS.%s: no contract case calls it, or recordingFS does not note it: add both", m)
				}
			}
		})
	}
}

// hostFSMethods names the methods of hostFS.
func hostFSMethods() []string {
	it := reflect.TypeFor[hostFS]()
	names := make([]string, it.NumMethod())
	for i := range names {
		names[i] = it.Method(i).Name
	}
	return names
}

// noHook is a beforeMkfs that lets the format go on.
func noHook() error { return nil }

// hostFSContract is what the fake and package fs both do, case by case.
var hostFSContract = []struct {
	name string
	run  func(t *testing.T, h hostUnderTest)
}{
	{"FormatsOnceAndKeepsTheUUID", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		formatted, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, noHook)
		if !formatted || err != nil {
			t.Fatalf("EnsureFilesystem(blank) = %v, %v; want true, nil", formatted, err)
		}
		uuid, err := h.host.FilesystemUUID(dev, "ext4")
		if uuid == "" || err != nil {
			t.Fatalf("FilesystemUUID = %q, %v", uuid, err)
		}
		formatted, err = h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, noHook)
		if formatted || err != nil {
			t.Errorf("EnsureFilesystem(ext4 already) = %v, %v; want false, nil", formatted, err)
		}
		if again, err := h.host.FilesystemUUID(dev, "ext4"); again != uuid || err != nil {
			t.Errorf("FilesystemUUID after the second EnsureFilesystem = %q, %v; want %q", again, err, uuid)
		}
		if u, err := h.host.FilesystemUUID(dev, "xfs"); err == nil {
			t.Errorf("FilesystemUUID(ext4 device, xfs) = %q, nil; want an error", u)
		}
	}},
	{"RefusesAnotherFilesystem", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		if _, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, noHook); err != nil {
			t.Fatal(err)
		}
		uuid, _ := h.host.FilesystemUUID(dev, "ext4")
		called := false
		_, err := h.host.EnsureFilesystem(t.Context(), dev, "xfs", fs.MkfsParams{}, nil, func() error { called = true; return nil })
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("EnsureFilesystem(ext4 device, xfs) = %v; want ErrFailedPrecondition", err)
		}
		if called {
			t.Error("the hook before mkfs ran for a device holding ext4")
		}
		if after, err := h.host.FilesystemUUID(dev, "ext4"); after != uuid || err != nil {
			t.Errorf("ext4 after the refusal: UUID %q, %v; want %q", after, err, uuid)
		}
	}},
	{"RefusesForeignData", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		h.foreign(t, dev)
		called := false
		formatted, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, func() error { called = true; return nil })
		if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("EnsureFilesystem(foreign data) = %v, %v; want false, ErrFailedPrecondition", formatted, err)
		}
		if called {
			t.Error("the hook before mkfs ran for a device holding data")
		}
	}},
	{"HookErrorStopsTheFormat", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		stop := errors.New("the record of the format could not be written")
		formatted, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, func() error { return stop })
		if formatted || !errors.Is(err, stop) {
			t.Fatalf("EnsureFilesystem(hook fails) = %v, %v; want false and the hook's error", formatted, err)
		}
		if u, err := h.host.FilesystemUUID(dev, "ext4"); err == nil {
			t.Errorf("the device has an ext4 (UUID %q) after the hook stopped the format", u)
		}
		if formatted, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, noHook); !formatted || err != nil {
			t.Errorf("EnsureFilesystem after a stopped format = %v, %v; want true, nil (still blank)", formatted, err)
		}
	}},
	{"FormatOverwrites", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		uuid, _ := h.host.FilesystemUUID(dev, "ext4")
		if err := h.host.Format(t.Context(), dev, "ext4", fs.MkfsParams{}); err != nil {
			t.Fatalf("Format(ext4 device, ext4) = %v", err)
		}
		if again, err := h.host.FilesystemUUID(dev, "ext4"); again == uuid || again == "" || err != nil {
			t.Errorf("FilesystemUUID after Format = %q, %v; want a new filesystem's, not %q", again, err, uuid)
		}
		other, _, _, _ := h.blank(t)
		h.foreign(t, other)
		if err := h.host.Format(t.Context(), other, "ext4", fs.MkfsParams{}); err != nil {
			t.Fatalf("Format(foreign data) = %v", err)
		}
		if formatted, err := h.host.EnsureFilesystem(t.Context(), other, "ext4", fs.MkfsParams{}, nil, noHook); formatted || err != nil {
			t.Errorf("EnsureFilesystem after Format = %v, %v; want false, nil", formatted, err)
		}
		// mkfs refuses a mounted device, and nothing says so but its
		// message.
		mountOn(t, h, dev, "ext4")
		uuid, _ = h.host.FilesystemUUID(dev, "ext4")
		if err := h.host.Format(t.Context(), dev, "ext4", fs.MkfsParams{}); err == nil || Code(err) != codes.Internal {
			t.Errorf("Format(mounted) = %v (%v); want an Internal error", err, Code(err))
		}
		if again, err := h.host.FilesystemUUID(dev, "ext4"); again != uuid || err != nil {
			t.Errorf("FilesystemUUID after Format(mounted) = %q, %v; want %q, unchanged", again, err, uuid)
		}
	}},
	{"UnsupportedFilesystemType", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		const btrfs = "btrfs"
		if !slices.Equal(h.host.SupportedFsTypes(), []string{"ext4", "xfs"}) {
			t.Errorf("SupportedFsTypes = %q; want ext4, xfs", h.host.SupportedFsTypes())
		}
		for what, err := range map[string]error{
			"EnsureFilesystem": func() error {
				_, err := h.host.EnsureFilesystem(t.Context(), dev, btrfs, fs.MkfsParams{}, nil, noHook)
				return err
			}(),
			"Format":         h.host.Format(t.Context(), dev, btrfs, fs.MkfsParams{}),
			"Fsck":           h.host.Fsck(t.Context(), dev, btrfs),
			"Resize":         h.host.Resize(t.Context(), dev, "", btrfs),
			"FilesystemUUID": func() error { _, err := h.host.FilesystemUUID(dev, btrfs); return err }(),
		} {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("%s(%s) = %v; want ErrInvalidArgument", what, btrfs, err)
			}
		}
		if formatted, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, noHook); !formatted || err != nil {
			t.Errorf("EnsureFilesystem after the refusals = %v, %v; want true, nil (still blank)", formatted, err)
		}
	}},
	{"NoDevice", func(t *testing.T, h hostUnderTest) {
		dir := t.TempDir()
		missing := filepath.Join(dir, "gone")
		file := filepath.Join(dir, "image")
		if err := os.WriteFile(file, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		// Every method that takes a device path says which of the
		// two it was given: the callers' gRPC codes (NotFound,
		// InvalidArgument) come from it.
		for _, c := range []struct {
			path string
			want error
		}{{missing, errdefs.ErrNotFound}, {file, errdefs.ErrInvalidArgument}} {
			for what, err := range map[string]error{
				"EnsureFilesystem": func() error {
					_, err := h.host.EnsureFilesystem(t.Context(), c.path, "ext4", fs.MkfsParams{}, nil, noHook)
					return err
				}(),
				"Format":            h.host.Format(t.Context(), c.path, "ext4", fs.MkfsParams{}),
				"Fsck":              h.host.Fsck(t.Context(), c.path, "ext4"),
				"Resize":            h.host.Resize(t.Context(), c.path, "", "ext4"),
				"BlockDeviceSize":   func() error { _, err := h.host.BlockDeviceSize(c.path); return err }(),
				"FlushBuffers":      h.host.FlushBuffers(c.path),
				"SetDeviceReadOnly": h.host.SetDeviceReadOnly(c.path, true),
				"DeviceReadOnly":    func() error { _, err := h.host.DeviceReadOnly(c.path); return err }(),
			} {
				if !errors.Is(err, c.want) {
					t.Errorf("%s(%s) = %v; want %v", what, filepath.Base(c.path), err, c.want)
				}
			}
		}
		if err := h.host.Fsck(t.Context(), missing, "xfs"); err != nil {
			t.Errorf("Fsck(missing, xfs) = %v; want nil: xfs is never checked", err)
		}
		if _, err := h.host.FilesystemUUID(missing, "ext4"); err == nil {
			t.Error("FilesystemUUID(missing) = nil error")
		}
		if n, err := h.host.OpenDeviceNode(missing, 7, 0); !errors.Is(err, errdefs.ErrNotFound) {
			n.Close()
			t.Errorf("OpenDeviceNode(missing) = %v; want ErrNotFound", err)
		}
		target := filepath.Join(t.TempDir(), "staging")
		th := mkdirOpen(t, target)
		if err := h.host.Mount(missing, th, "ext4", 0, ""); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Mount(missing) = %v; want ErrNotFound", err)
		}
		if _, err := h.host.MountInfo(th); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("MountInfo after a failed Mount = %v; want ErrNotFound", err)
		}
	}},
	{"Fsck", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		if err := h.host.Fsck(t.Context(), dev, "ext4"); err != nil {
			t.Errorf("Fsck(clean ext4) = %v", err)
		}
		mountOn(t, h, dev, "ext4")
		if err := h.host.Fsck(t.Context(), dev, "ext4"); err != nil {
			t.Errorf("Fsck(mounted ext4) = %v; want nil, not checked", err)
		}
	}},
	{"MountRefusals", func(t *testing.T, h hostUnderTest) {
		blank, _, _, _ := h.blank(t)
		target := filepath.Join(t.TempDir(), "staging")
		th := mkdirOpen(t, target)
		// No sentinel: the kernel's EINVAL, which the callers report
		// as Internal.
		if err := h.host.Mount(blank, th, "ext4", 0, ""); err == nil || Code(err) != codes.Internal {
			t.Errorf("Mount(blank device) = %v (%v); want an Internal error", err, Code(err))
		}
		dev, major, minor, _ := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		if err := h.host.Mount(dev, th, "xfs", 0, ""); err == nil || Code(err) != codes.Internal {
			t.Errorf("Mount(ext4 as xfs) = %v (%v); want an Internal error", err, Code(err))
		}
		if _, err := h.host.MountInfo(th); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("MountInfo after the refused mounts = %v; want ErrNotFound", err)
		}
		if err := h.host.Mount(dev, th, "ext4", 0, ""); err != nil {
			t.Fatalf("Mount: %v", err)
		}
		ph, _ := openParent(t, target)
		t.Cleanup(func() { h.host.Unmount(ph, "staging", nil) })
		if err := h.host.Mount(dev, th, "ext4", 0, ""); !errors.Is(err, errdefs.ErrBusy) {
			t.Errorf("Mount again on its own mount = %v; want ErrBusy", err)
		}
		if points, err := h.host.MountPoints(major, minor); len(points) != 1 || err != nil {
			t.Errorf("MountPoints after the second Mount = %q, %v; want only %s", points, err, target)
		}
	}},
	{"UnmountBusy", func(t *testing.T, h hostUnderTest) {
		dev, major, minor, _ := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		ph, staging := mountOn(t, h, dev, "ext4")
		inner, _, _, _ := h.blank(t)
		mustFormat(t, h, inner, "ext4")
		// The handle of the directory inside is closed before the
		// unmount: only the mount inside keeps the staging mount busy.
		ih := mkdirOpen(t, filepath.Join(staging, "inner"))
		err := h.host.Mount(inner, ih, "ext4", 0, "")
		ih.Close()
		if err != nil {
			t.Fatalf("Mount inside: %v", err)
		}
		unmountInner := func() error {
			sh, err := ph.OpenAt("staging")
			if err != nil {
				return err
			}
			defer sh.Close()
			return h.host.Unmount(sh, "inner", nil)
		}
		t.Cleanup(func() { unmountInner() })
		if err := h.host.Unmount(ph, "staging", nil); !errors.Is(err, errdefs.ErrBusy) {
			t.Errorf("Unmount with a mount inside = %v; want ErrBusy", err)
		}
		if points, _ := h.host.MountPoints(major, minor); !slices.Contains(points, staging) {
			t.Fatalf("the busy Unmount unmounted %s", staging)
		}
		if err := unmountInner(); err != nil {
			t.Fatalf("Unmount inside: %v", err)
		}
		mustUnmount(t, h, ph, "staging")
		if err := h.host.Unmount(ph, "gone", nil); err != nil {
			t.Errorf("Unmount of a missing name = %v; want nil", err)
		}
	}},
	{"BindFilesystem", func(t *testing.T, h hostUnderTest) {
		dev, major, minor, _ := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		ph, staging := mountOn(t, h, dev, "ext4")
		src, err := fs.OpenPath(staging)
		if err != nil {
			t.Fatal(err)
		}
		defer src.Close()
		want, err := h.host.MountInfo(src)
		if err != nil {
			t.Fatal(err)
		}
		pubDir := t.TempDir()
		dh, err := fs.OpenPath(pubDir)
		if err != nil {
			t.Fatal(err)
		}
		defer dh.Close()
		target := filepath.Join(pubDir, "target")
		byName := mkdirOpen(t, target)
		if err := h.host.BindMount(src, byName, false, 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("BindMount on a target from OpenPath = %v; want ErrInvalidArgument", err)
		}
		th, err := dh.OpenAt("target")
		if err != nil {
			t.Fatal(err)
		}
		defer th.Close()
		if err := h.host.BindMount(src, th, true, 0); err != nil {
			t.Fatalf("BindMount: %v", err)
		}
		t.Cleanup(func() { h.host.Unmount(dh, "target", nil) })
		src.Close()
		if got := mountInfoAt(t, h, target); got != want {
			t.Errorf("MountInfo(bind) = %+v; want the staging mount's %+v", got, want)
		}
		points, err := h.host.MountPoints(major, minor)
		if slices.Sort(points); !slices.Equal(points, sortedOf(staging, target)) || err != nil {
			t.Errorf("MountPoints = %q, %v; want %s and %s", points, err, staging, target)
		}
		mustUnmount(t, h, dh, "target")
		mustUnmount(t, h, ph, "staging")
	}},
	{"BindDeviceNode", func(t *testing.T, h hostUnderTest) {
		dev, major, minor, _ := h.blank(t)
		if n, err := h.host.OpenDeviceNode(dev, major, minor+1); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			n.Close()
			t.Errorf("OpenDeviceNode(%s, %d:%d) = %v; want ErrFailedPrecondition", dev, major, minor+1, err)
		}
		src, err := h.host.OpenDeviceNode(dev, major, minor)
		if err != nil {
			t.Fatalf("OpenDeviceNode: %v", err)
		}
		defer src.Close()
		pubDir := t.TempDir()
		dh, err := fs.OpenPath(pubDir)
		if err != nil {
			t.Fatal(err)
		}
		defer dh.Close()
		if err := dh.CreateAt("target", 0o600); err != nil {
			t.Fatal(err)
		}
		th, err := dh.OpenAt("target")
		if err != nil {
			t.Fatal(err)
		}
		defer th.Close()
		if err := h.host.BindMount(src, th, false, 0); err != nil {
			t.Fatalf("BindMount(device node): %v", err)
		}
		t.Cleanup(func() { h.host.Unmount(dh, "target", nil) })
		target := filepath.Join(pubDir, "target")
		if got := mountInfoAt(t, h, target); uint32(got.RdevMajor) != major || uint32(got.RdevMinor) != minor {
			t.Errorf("MountInfo(bind of the device node) = %+v; want device node %d:%d", got, major, minor)
		}
		// The bind is of the node, not of a filesystem on the device.
		if points, err := h.host.MountPoints(major, minor); len(points) != 0 || err != nil {
			t.Errorf("MountPoints(%d:%d) = %q, %v; want none", major, minor, points, err)
		}
		bound, err := th.Reopen()
		if err != nil {
			t.Fatal(err)
		}
		_, err = h.host.Trim(t.Context(), bound)
		bound.Close()
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Trim(bind of a device node) = %v; want ErrInvalidArgument", err)
		}
		mustUnmount(t, h, dh, "target")
	}},
	{"TrimAndStats", func(t *testing.T, h hostUnderTest) {
		dev, _, _, size := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		_, staging := mountOn(t, h, dev, "ext4")
		st, err := h.host.Stats(staging)
		if err != nil {
			t.Fatalf("Stats: %v", err)
		}
		if st.TotalBytes <= 0 || st.TotalBytes > size || st.UsedBytes <= 0 || st.UsedBytes+st.AvailableBytes > st.TotalBytes ||
			st.TotalInodes <= 0 || st.FreeInodes >= st.TotalInodes || st.UsedInodes != st.TotalInodes-st.FreeInodes {
			t.Errorf("Stats of a new ext4 on %d bytes = %+v", size, st)
		}
		for p, want := range map[string]error{
			filepath.Join(staging, "gone"): errdefs.ErrNotFound,
			"relative":                     errdefs.ErrInvalidArgument,
		} {
			if _, err := h.host.Stats(p); !errors.Is(err, want) {
				t.Errorf("Stats(%s) = %v; want %v", p, err, want)
			}
		}
		root, err := fs.OpenPath(staging)
		if err != nil {
			t.Fatal(err)
		}
		n, err := h.host.Trim(t.Context(), root)
		root.Close()
		if err != nil || n == 0 || int64(n) > st.TotalBytes {
			t.Errorf("Trim = %d, %v; want its free space trimmed, at most %d bytes", n, err, st.TotalBytes)
		}
		dir := t.TempDir()
		dh, err := fs.OpenPath(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer dh.Close()
		if _, err := h.host.Trim(t.Context(), dh); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Trim(a directory that is no mount) = %v; want ErrInvalidArgument", err)
		}
	}},
	{"Resize", func(t *testing.T, h hostUnderTest) {
		dev, _, _, _ := h.blank(t)
		mustFormat(t, h, dev, "ext4")
		// A filesystem that fills its device already: nothing to do.
		if err := h.host.Resize(t.Context(), dev, "", "ext4"); err != nil {
			t.Errorf("Resize offline = %v", err)
		}
		if err := h.host.Resize(t.Context(), dev, "", "xfs"); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Resize of xfs without a mount path = %v; want ErrInvalidArgument", err)
		}
		unmounted := t.TempDir()
		if err := h.host.Resize(t.Context(), dev, unmounted, "ext4"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Resize at a path where nothing is mounted = %v; want ErrNotFound", err)
		}
		_, staging := mountOn(t, h, dev, "ext4")
		if err := h.host.Resize(t.Context(), dev, staging, "ext4"); err != nil {
			t.Errorf("Resize online = %v", err)
		}
		if err := h.host.Resize(t.Context(), dev, staging, "xfs"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("Resize as xfs of an ext4 mount = %v; want ErrFailedPrecondition", err)
		}
		other, _, _, _ := h.blank(t)
		mustFormat(t, h, other, "ext4")
		if err := h.host.Resize(t.Context(), other, staging, "ext4"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("Resize at the mount of another device = %v; want ErrFailedPrecondition", err)
		}
	}},
	{"MountCycle", func(t *testing.T, h hostUnderTest) {
		dev, major, minor, _ := h.blank(t)
		if _, err := h.host.EnsureFilesystem(t.Context(), dev, "ext4", fs.MkfsParams{}, nil, noHook); err != nil {
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
	}},
	{"ReadOnlyFlagAndSize", func(t *testing.T, h hostUnderTest) {
		dev, _, _, size := h.blank(t)
		if n, err := h.host.BlockDeviceSize(dev); n != size || err != nil {
			t.Errorf("BlockDeviceSize = %d, %v; want %d", n, err, size)
		}
		if err := h.host.FlushBuffers(dev); err != nil {
			t.Errorf("FlushBuffers = %v", err)
		}
		for _, ro := range []bool{true, false} {
			if err := h.host.SetDeviceReadOnly(dev, ro); err != nil {
				t.Fatalf("SetDeviceReadOnly(%v): %v", ro, err)
			}
			if got, err := h.host.DeviceReadOnly(dev); got != ro || err != nil {
				t.Errorf("DeviceReadOnly after SetDeviceReadOnly(%v) = %v, %v", ro, got, err)
			}
		}
	}},
	{"MountOptions", func(t *testing.T, h hostUnderTest) {
		if !slices.Contains(h.host.SupportedFsTypes(), "ext4") || !slices.Contains(h.host.SupportedFsTypes(), "xfs") {
			t.Errorf("SupportedFsTypes = %q; want ext4 and xfs", h.host.SupportedFsTypes())
		}
		if _, _, err := h.host.ParseMountOptions([]string{"errors=panic"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("ParseMountOptions(errors=panic) = %v; want ErrInvalidArgument", err)
		}
		if _, _, err := h.host.ParseMountOptions([]string{"noatime"}); err != nil {
			t.Errorf("ParseMountOptions(noatime) = %v", err)
		}
	}},
}

// mustFormat makes fsType on dev.
func mustFormat(t *testing.T, h hostUnderTest, dev, fsType string) {
	t.Helper()
	if _, err := h.host.EnsureFilesystem(t.Context(), dev, fsType, fs.MkfsParams{}, nil, noHook); err != nil {
		t.Fatal(err)
	}
}

// mkdirOpen makes the directory p and opens it.
func mkdirOpen(t *testing.T, p string) *fs.Handle {
	t.Helper()
	if err := os.Mkdir(p, 0o750); err != nil {
		t.Fatal(err)
	}
	h, err := fs.OpenPath(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// openParent opens the directory of p.
func openParent(t *testing.T, p string) (*fs.Handle, string) {
	t.Helper()
	dir, name, err := fs.OpenParent(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dir.Close() })
	return dir, name
}

// mountOn mounts the fsType on dev at a new directory "staging" and
// returns its directory and its path; the test's end unmounts it.
func mountOn(t *testing.T, h hostUnderTest, dev, fsType string) (*fs.Handle, string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "staging")
	th := mkdirOpen(t, p)
	dir, name := openParent(t, p)
	if err := h.host.Mount(dev, th, fsType, 0, ""); err != nil {
		t.Fatalf("Mount: %v", err)
	}
	th.Close()
	t.Cleanup(func() { h.host.Unmount(dir, name, nil) })
	return dir, p
}

// mustUnmount unmounts name in dir and checks that nothing is left.
func mustUnmount(t *testing.T, h hostUnderTest, dir *fs.Handle, name string) {
	t.Helper()
	if err := h.host.Unmount(dir, name, nil); err != nil {
		t.Fatalf("Unmount %s: %v", name, err)
	}
	m, err := dir.OpenAt(name)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if e, err := h.host.MountInfo(m); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("MountInfo after Unmount %s = %+v, %v; want ErrNotFound", name, e, err)
	}
}

// mountInfoAt is MountInfo of what is mounted at p.
func mountInfoAt(t *testing.T, h hostUnderTest, p string) mountEntry {
	t.Helper()
	m, err := fs.OpenPath(p)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	e, err := h.host.MountInfo(m)
	if err != nil {
		t.Fatalf("MountInfo(%s): %v", p, err)
	}
	return e
}

func sortedOf(s ...string) []string {
	slices.Sort(s)
	return s
}

// recordingFS notes which of its methods were called. It embeds the
// implementation, so that a method added to hostFS passes through
// unnoted and TestHostFSContract reports it.
type recordingFS struct {
	hostFS
	called map[string]bool
}

func (r *recordingFS) SupportedFsTypes() []string {
	r.called["SupportedFsTypes"] = true
	return r.hostFS.SupportedFsTypes()
}

func (r *recordingFS) ParseMountOptions(opts []string) (uintptr, string, error) {
	r.called["ParseMountOptions"] = true
	return r.hostFS.ParseMountOptions(opts)
}

func (r *recordingFS) EnsureFilesystem(ctx context.Context, devPath, fsType string, p fs.MkfsParams, image func() (*os.File, int64, error), beforeMkfs func() error) (bool, error) {
	r.called["EnsureFilesystem"] = true
	return r.hostFS.EnsureFilesystem(ctx, devPath, fsType, p, image, beforeMkfs)
}

func (r *recordingFS) Format(ctx context.Context, devPath, fsType string, p fs.MkfsParams) error {
	r.called["Format"] = true
	return r.hostFS.Format(ctx, devPath, fsType, p)
}

func (r *recordingFS) Fsck(ctx context.Context, devPath, fsType string) error {
	r.called["Fsck"] = true
	return r.hostFS.Fsck(ctx, devPath, fsType)
}

func (r *recordingFS) FilesystemUUID(devPath, fsType string) (string, error) {
	r.called["FilesystemUUID"] = true
	return r.hostFS.FilesystemUUID(devPath, fsType)
}

func (r *recordingFS) Mount(source string, target *fs.Handle, fsType string, flags uintptr, data string) error {
	r.called["Mount"] = true
	return r.hostFS.Mount(source, target, fsType, flags, data)
}

func (r *recordingFS) BindMount(source, target *fs.Handle, readOnly bool, flags uintptr) error {
	r.called["BindMount"] = true
	return r.hostFS.BindMount(source, target, readOnly, flags)
}

func (r *recordingFS) Unmount(dir *fs.Handle, name string, check func(mountEntry) error) error {
	r.called["Unmount"] = true
	return r.hostFS.Unmount(dir, name, check)
}

func (r *recordingFS) OpenDeviceNode(path string, major, minor uint32) (*fs.Handle, error) {
	r.called["OpenDeviceNode"] = true
	return r.hostFS.OpenDeviceNode(path, major, minor)
}

func (r *recordingFS) MountInfo(h *fs.Handle) (mountEntry, error) {
	r.called["MountInfo"] = true
	return r.hostFS.MountInfo(h)
}

func (r *recordingFS) MountPoints(major, minor uint32) ([]string, error) {
	r.called["MountPoints"] = true
	return r.hostFS.MountPoints(major, minor)
}

func (r *recordingFS) Trim(ctx context.Context, h *fs.Handle) (uint64, error) {
	r.called["Trim"] = true
	return r.hostFS.Trim(ctx, h)
}

func (r *recordingFS) Resize(ctx context.Context, devPath, mountPath, fsType string) error {
	r.called["Resize"] = true
	return r.hostFS.Resize(ctx, devPath, mountPath, fsType)
}

func (r *recordingFS) Stats(path string) (fsStats, error) {
	r.called["Stats"] = true
	return r.hostFS.Stats(path)
}

func (r *recordingFS) BlockDeviceSize(devPath string) (int64, error) {
	r.called["BlockDeviceSize"] = true
	return r.hostFS.BlockDeviceSize(devPath)
}

func (r *recordingFS) FlushBuffers(devPath string) error {
	r.called["FlushBuffers"] = true
	return r.hostFS.FlushBuffers(devPath)
}

func (r *recordingFS) SetDeviceReadOnly(devPath string, ro bool) error {
	r.called["SetDeviceReadOnly"] = true
	return r.hostFS.SetDeviceReadOnly(devPath, ro)
}

func (r *recordingFS) DeviceReadOnly(devPath string) (bool, error) {
	r.called["DeviceReadOnly"] = true
	return r.hostFS.DeviceReadOnly(devPath)
}
