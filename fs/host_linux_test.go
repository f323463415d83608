package fs

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/logctx"
	"github.com/berth-csi/berth/internal/testutil"
)

const mib = 1 << 20

// needTools skips (fails in CI) when a tool the test drives is missing.
func needTools(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := lookTool(n); err != nil {
			testutil.SkipOrFail(t, fmt.Sprintf("host test needs %s (make deps): %v", n, err))
		}
	}
}

func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// sparseFile creates a sparse file of size bytes in a test directory and
// lets prepare write to it before it is attached.
func sparseFile(t testing.TB, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "backing.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return p
}

// attachLoop attaches file to a free loop device, detached at cleanup.
func attachLoop(t testing.TB, file string) string {
	t.Helper()
	dev := strings.TrimSpace(run(t, "losetup", "--find", "--show", "--", file))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup --detach %s: %v: %s", dev, err, out)
		}
	})
	return dev
}

// newLoop is a loop device over a fresh sparse file.
func newLoop(t *testing.T, size int64) (dev, file string) {
	t.Helper()
	file = sparseFile(t, size)
	return attachLoop(t, file), file
}

func hashFile(t *testing.T, p string) [32]byte {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [32]byte(h.Sum(nil))
}

func writeAt(t *testing.T, p string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func TestHostEnsureFilesystemFormatsBlank(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	for _, tc := range []struct {
		fsType, label string
		size          int64
	}{
		{Ext4, "berth-ext4", 64 * mib},
		{XFS, "berth-xfs", 320 * mib}, // xfsprogs refuses filesystems under 300 MB
	} {
		t.Run(tc.fsType, func(t *testing.T) {
			needTools(t, "blkid", "mkfs."+tc.fsType)
			dev, _ := newLoop(t, tc.size)
			ctx := context.Background()
			if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
				t.Fatalf("fresh device: Probe = %+v, %v; want blank", sig, err)
			}
			formatted, err := EnsureFilesystem(ctx, dev, tc.fsType, MkfsOptions{Label: tc.label})
			if err != nil || !formatted {
				t.Fatalf("EnsureFilesystem = %v, %v; want formatted", formatted, err)
			}
			sig, err := Probe(ctx, dev)
			if err != nil || sig.Type != tc.fsType || sig.Label != tc.label || sig.UUID == "" {
				t.Fatalf("after format: Probe = %+v, %v", sig, err)
			}
			formatted, err = EnsureFilesystem(ctx, dev, tc.fsType, MkfsOptions{Label: "other"})
			if err != nil || formatted {
				t.Fatalf("second EnsureFilesystem = %v, %v; want reuse", formatted, err)
			}
			if again, _ := Probe(ctx, dev); again.UUID != sig.UUID || again.Label != tc.label {
				t.Fatalf("second EnsureFilesystem changed the filesystem: %+v -> %+v", sig, again)
			}
		})
	}
}

// TestHostSuperblockCheck checks the post-mkfs check against what the
// real tools write, and that a blank or other filesystem does not pass.
func TestHostSuperblockCheck(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "mkfs.ext4", "mkfs.xfs")
	ext4, _ := newLoop(t, 64*mib)
	xfs, _ := newLoop(t, 320*mib)
	blank, _ := newLoop(t, 64*mib)
	run(t, "mkfs.ext4", "-q", "-F", ext4)
	run(t, "mkfs.xfs", "-q", "-f", xfs)
	for _, tc := range []struct {
		dev, fsType string
		want        bool
	}{
		{ext4, Ext4, true}, {ext4, XFS, false},
		{xfs, XFS, true}, {xfs, Ext4, false},
		{blank, Ext4, false}, {blank, XFS, false},
	} {
		got, err := hasSuperblock(context.Background(), tc.dev, tc.fsType)
		if err != nil || got != tc.want {
			t.Errorf("hasSuperblock(%s, %s) = %v, %v; want %v", tc.dev, tc.fsType, got, err, tc.want)
		}
	}
}

func TestHostEnsureFilesystemReusesExisting(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4")
	file := sparseFile(t, 64*mib)
	const uuid = "0b4a5bde-7a3c-4c5e-9f36-3d8e1c2b7a10"
	run(t, "/usr/sbin/mkfs.ext4", "-q", "-F", "-U", uuid, file)
	dev := attachLoop(t, file)
	before := hashFile(t, file)
	formatted, err := EnsureFilesystem(context.Background(), dev, Ext4, MkfsOptions{})
	if err != nil || formatted {
		t.Fatalf("EnsureFilesystem = %v, %v; want existing ext4 reused", formatted, err)
	}
	if hashFile(t, file) != before {
		t.Fatal("device bytes changed")
	}
	if sig, _ := Probe(context.Background(), dev); sig.UUID != uuid {
		t.Fatalf("uuid %q, want %q", sig.UUID, uuid)
	}
}

// mbr returns a DOS partition table with one Linux partition, for hosts
// without sfdisk.
func mbr() []byte {
	b := make([]byte, 512)
	binary.LittleEndian.PutUint32(b[440:], 0x5eed0001) // disk identifier
	e := b[446:462]
	e[4] = 0x83                                  // Linux
	binary.LittleEndian.PutUint32(e[8:], 2048)   // first LBA
	binary.LittleEndian.PutUint32(e[12:], 20480) // sectors
	b[510], b[511] = 0x55, 0xaa
	return b
}

// luks1Header returns a LUKS1 header (cryptsetup's on-disk format).
func luks1Header() []byte {
	b := make([]byte, 592)
	copy(b, "LUKS\xba\xbe")
	binary.BigEndian.PutUint16(b[6:], 1)
	copy(b[8:], "aes")
	copy(b[40:], "xts-plain64")
	copy(b[72:], "sha256")
	binary.BigEndian.PutUint32(b[104:], 4096) // payload offset
	binary.BigEndian.PutUint32(b[108:], 64)   // key bytes
	copy(b[168:], "6b3c1f0e-8d3e-4f7a-9c2b-0a1b2c3d4e5f")
	return b
}

// luks2SecondaryHeader returns the start of a LUKS2 binary header as
// cryptsetup writes its secondary copies, for a copy at off.
func luks2SecondaryHeader(off int64) []byte {
	b := make([]byte, 512)
	copy(b, "SKUL\xba\xbe")
	binary.BigEndian.PutUint16(b[6:], 2)
	binary.BigEndian.PutUint64(b[8:], 16384) // header size
	binary.BigEndian.PutUint64(b[256:], uint64(off))
	return b
}

// md090 returns an md 0.90 superblock and its offset on a device of size
// bytes: the last 64 KiB-aligned 64 KiB block, far outside the first MiB.
func md090(size int64) ([]byte, int64) {
	b := make([]byte, 4096)
	for i, v := range []uint32{0xa92b4efc, 0, 90, 0, 0, 0x11111111, 0, 1, 0, 2, 2, 0, 0, 0x22222222, 0x33333333, 0x44444444} {
		binary.LittleEndian.PutUint32(b[4*i:], v)
	}
	return b, size&^(64*1024-1) - 64*1024
}

func TestHostEnsureFilesystemRefuses(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4", "mkfs.xfs")
	const size = 64 * mib
	_, hasSfdisk := exec.LookPath("sfdisk")
	_, hasMkswap := exec.LookPath("mkswap")
	for _, tc := range []struct {
		name      string
		requested string
		prepare   func(t *testing.T, file string)
		wantType  string
	}{
		{"xfs when ext4 requested", Ext4, func(t *testing.T, f string) {
			// xfsprogs refuses filesystems under 300 MB.
			if err := os.Truncate(f, 320*mib); err != nil {
				t.Fatal(err)
			}
			run(t, "/usr/sbin/mkfs.xfs", "-q", "-f", f)
		}, "xfs"},
		{"ext4 when xfs requested", XFS, func(t *testing.T, f string) { run(t, "/usr/sbin/mkfs.ext4", "-q", "-F", f) }, "ext4"},
		{"gpt partition table", Ext4, func(t *testing.T, f string) {
			if hasSfdisk != nil {
				testutil.SkipOrFail(t, "sfdisk missing (make deps)")
			}
			cmd := exec.Command("sfdisk", "-q", f)
			cmd.Stdin = strings.NewReader("label: gpt\nsize=8MiB, type=linux\n")
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("sfdisk: %v: %s", err, out)
			}
		}, "gpt"},
		{"dos partition table", Ext4, func(t *testing.T, f string) { writeAt(t, f, 0, mbr()) }, "dos"},
		{"gpt backup header only", XFS, func(t *testing.T, f string) {
			if hasSfdisk != nil {
				testutil.SkipOrFail(t, "sfdisk missing (make deps)")
			}
			cmd := exec.Command("sfdisk", "-q", f)
			cmd.Stdin = strings.NewReader("label: gpt\n")
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("sfdisk: %v: %s", err, out)
			}
			writeAt(t, f, 0, make([]byte, mib)) // erase MBR and primary GPT
		}, "gpt-backup"},
		{"luks header", Ext4, func(t *testing.T, f string) { writeAt(t, f, 0, luks1Header()) }, "crypto_LUKS"},
		{"swap", Ext4, func(t *testing.T, f string) {
			if hasMkswap != nil {
				testutil.SkipOrFail(t, "mkswap missing (make deps)")
			}
			run(t, "mkswap", f)
		}, "swap"},
		{"md 0.90 superblock at the end", Ext4, func(t *testing.T, f string) {
			sb, off := md090(size)
			writeAt(t, f, off, sb)
		}, "linux_raid_member"},
		// Signatures only in the far windows: the first and the last
		// MiB are zero, so only blkid can name these.
		{"VMFS volume member at 1 MiB", Ext4, func(t *testing.T, f string) { writeAt(t, f, 1*mib, []byte{0x0d, 0xd0, 0x01, 0xc0}) }, "VMFS_volume_member"},
		{"VMFS at 2 MiB", Ext4, func(t *testing.T, f string) { writeAt(t, f, 2*mib, []byte{0x5e, 0xf1, 0xab, 0x2f}) }, "VMFS"},
		{"LUKS2 secondary header at 4 MiB only", XFS, func(t *testing.T, f string) { writeAt(t, f, 4*mib, luks2SecondaryHeader(4*mib)) }, "crypto_LUKS"},
		{"Promise RAID 3087 sectors before the end", Ext4, func(t *testing.T, f string) {
			writeAt(t, f, size-3087*512, []byte("Promise Technology, Inc."))
		}, "promise_fasttrack_raid_member"},
		{"random bytes in the first MiB", Ext4, func(t *testing.T, f string) {
			b := make([]byte, 16)
			rand.Read(b)
			b[0] |= 1
			writeAt(t, f, 700*1024, b)
		}, "unknown-data"},
		{"one byte at the end", XFS, func(t *testing.T, f string) { writeAt(t, f, size-1, []byte{1}) }, "unknown-data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := sparseFile(t, size)
			tc.prepare(t, file)
			dev := attachLoop(t, file)
			before := hashFile(t, file)

			sig, err := Probe(context.Background(), dev)
			if err != nil {
				t.Fatal(err)
			}
			if sig.Type != tc.wantType {
				t.Errorf("Probe = %+v, want type %q", sig, tc.wantType)
			}
			formatted, err := EnsureFilesystem(context.Background(), dev, tc.requested, MkfsOptions{})
			if err == nil || formatted {
				t.Fatalf("EnsureFilesystem(%s) = %v, %v; want refusal", tc.requested, formatted, err)
			}
			if !errors.Is(err, errdefs.ErrFailedPrecondition) {
				t.Errorf("error %v does not wrap ErrFailedPrecondition", err)
			}
			if !strings.Contains(err.Error(), tc.wantType) || !strings.Contains(err.Error(), dev) {
				t.Errorf("error %q does not name %q and the device", err, tc.wantType)
			}
			// wipefs does not clear unknown data: the advice must fit.
			// A LUKS header is an encrypted volume to be opened, not
			// erased: no wipefs advice.
			if wantWipefs := tc.wantType != "unknown-data" && tc.wantType != TypeLUKS; strings.Contains(err.Error(), "wipefs") != wantWipefs {
				t.Errorf("error %q: advice does not fit %s", err, tc.wantType)
			}
			if hashFile(t, file) != before {
				t.Fatal("device bytes changed")
			}
			t.Logf("refused: %v", err)
		})
	}
}

func TestHostEnsureFilesystemBadInput(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dev, file := newLoop(t, 8*mib)
	ctx := context.Background()
	for _, tc := range []struct {
		dev, fsType string
		opt         MkfsOptions
		want        error
	}{
		{dev, "btrfs", MkfsOptions{}, errdefs.ErrInvalidArgument},
		{dev, Ext4, MkfsOptions{ExtraArgs: []string{"/dev/sda"}}, errdefs.ErrInvalidArgument},
		{file, Ext4, MkfsOptions{}, errdefs.ErrInvalidArgument}, // a regular file
		{"/dev/berth-no-such-device", Ext4, MkfsOptions{}, errdefs.ErrNotFound},
	} {
		if _, err := EnsureFilesystem(ctx, tc.dev, tc.fsType, tc.opt); !errors.Is(err, tc.want) {
			t.Errorf("EnsureFilesystem(%s, %s, %+v) = %v, want %v", tc.dev, tc.fsType, tc.opt, err, tc.want)
		}
	}
	if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
		t.Errorf("device touched: %+v %v", sig, err)
	}
}

func TestHostFsck(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4", "e2fsck", "debugfs")
	ctx := context.Background()
	t.Run("clean", func(t *testing.T) {
		dev, _ := newLoop(t, 32*mib)
		if _, err := EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := Fsck(ctx, dev, Ext4); err != nil {
			t.Fatal(err)
		}
		if err := Fsck(ctx, dev, XFS); err != nil {
			t.Fatalf("xfs is never checked, got %v", err)
		}
	})
	t.Run("uncorrectable", func(t *testing.T) {
		file := sparseFile(t, 32*mib)
		run(t, "/usr/sbin/mkfs.ext4", "-q", "-F", file)
		// Clearing the root inode is beyond what preen mode may fix;
		// state 0 ("not clean") makes preen mode look at all.
		run(t, "debugfs", "-w", "-R", "clri <2>", file)
		run(t, "debugfs", "-w", "-R", "ssv state 0", file)
		dev := attachLoop(t, file)
		err := Fsck(ctx, dev, Ext4)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Fatalf("Fsck = %v, want ErrFailedPrecondition", err)
		}
		var te *command.Error
		if !errors.As(err, &te) || te.ExitCode&fsckUncorrected == 0 || !strings.Contains(err.Error(), "MANUALLY") {
			t.Fatalf("error %v lacks e2fsck's exit status 4 or its output", err)
		}
	})
	t.Run("corrected", func(t *testing.T) {
		file := sparseFile(t, 32*mib)
		run(t, "/usr/sbin/mkfs.ext4", "-q", "-F", file)
		run(t, "debugfs", "-w", "-R", "ssv state 0", file)
		dev := attachLoop(t, file)
		if err := Fsck(ctx, dev, Ext4); err != nil {
			t.Fatalf("Fsck of a not-cleanly-unmounted filesystem = %v, want nil (exit 1)", err)
		}
		// The check ran and marked the filesystem clean.
		out := run(t, "dumpe2fs", "-h", dev)
		if !regexp.MustCompile(`(?m)^Filesystem state:\s+clean$`).MatchString(out) {
			t.Fatalf("filesystem not clean after Fsck:\n%s", out)
		}
	})
	t.Run("mounted is skipped", func(t *testing.T) {
		dev, _ := newLoop(t, 32*mib)
		if _, err := EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{}); err != nil {
			t.Fatal(err)
		}
		mnt := t.TempDir()
		if err := Mount(dev, mnt, Ext4, 0, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { Unmount(mnt) })
		if err := Fsck(ctx, dev, Ext4); err != nil {
			t.Fatalf("Fsck on a mounted filesystem = %v, want nil (skipped)", err)
		}
	})
}

// mounted formats a fresh loop device and mounts it; unmounted at cleanup.
func mounted(t *testing.T, fsType string, size int64) (dev, file, mnt string) {
	t.Helper()
	needTools(t, "blkid", "mkfs."+fsType)
	dev, file = newLoop(t, size)
	if _, err := EnsureFilesystem(context.Background(), dev, fsType, MkfsOptions{}); err != nil {
		t.Fatal(err)
	}
	mnt = t.TempDir()
	if err := Mount(dev, mnt, fsType, MS_NODEV|MS_NOSUID, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Unmount(mnt); err != nil {
			t.Error(err)
		}
	})
	return dev, file, mnt
}

func TestHostMountBindUnmount(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dev, _, mnt := mounted(t, Ext4, 64*mib)

	ok, err := IsMountPoint(mnt)
	if err != nil || !ok {
		t.Fatalf("IsMountPoint(staging) = %v, %v", ok, err)
	}
	mi, err := MountInfo(mnt)
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	if mi.Source != dev || mi.FSType != Ext4 || mi.Major != int(unix.Major(st.Rdev)) || mi.Minor != int(unix.Minor(st.Rdev)) {
		t.Errorf("MountInfo = %+v, want %s ext4 %d:%d", mi, dev, unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	if !hasOpt(mi.Options, "nodev") || !hasOpt(mi.Options, "nosuid") || !hasOpt(mi.Options, "rw") {
		t.Errorf("mount options %q lack rw,nodev,nosuid", mi.Options)
	}

	// Read-write bind.
	rwTarget := t.TempDir()
	if err := BindMount(mnt, rwTarget, false, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rwTarget, "through-bind"), []byte("x"), 0o644); err != nil {
		t.Fatalf("write through rw bind: %v", err)
	}
	if _, err := os.Stat(filepath.Join(mnt, "through-bind")); err != nil {
		t.Fatalf("write through the bind not visible in staging: %v", err)
	}

	// Read-only bind with extra flags; the staging mount stays writable.
	roTarget := t.TempDir()
	if err := BindMount(mnt, roTarget, true, MS_NOEXEC); err != nil {
		t.Fatal(err)
	}
	err = os.WriteFile(filepath.Join(roTarget, "denied"), []byte("x"), 0o644)
	if !errors.Is(err, unix.EROFS) {
		t.Fatalf("write through ro bind: %v, want EROFS", err)
	}
	roInfo, err := MountInfo(roTarget)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range []string{"ro", "noexec", "nodev", "nosuid"} {
		if !hasOpt(roInfo.Options, o) {
			t.Errorf("ro bind options %q lack %s (flags of the source must be kept)", roInfo.Options, o)
		}
	}
	if err := os.WriteFile(filepath.Join(mnt, "still-rw"), []byte("x"), 0o644); err != nil {
		t.Fatalf("staging became read-only: %v", err)
	}

	if err := BindMount(mnt, t.TempDir(), false, MS_BIND); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bind with MS_BIND in flags: %v, want ErrInvalidArgument", err)
	}
	// Superblock flags from the same mount options are accepted and
	// left to the staging mount.
	syncTarget := t.TempDir()
	if err := BindMount(mnt, syncTarget, false, MS_SYNCHRONOUS|MS_NOATIME); err != nil {
		t.Fatalf("bind with sync,noatime: %v", err)
	}
	if si, err := MountInfo(syncTarget); err != nil || !hasOpt(si.Options, "noatime") || !hasOpt(si.Options, "rw") {
		t.Errorf("sync,noatime bind: %+v, %v; want rw,noatime", si, err)
	}
	if err := Unmount(syncTarget); err != nil {
		t.Fatal(err)
	}

	for _, target := range []string{roTarget, rwTarget} {
		if err := Unmount(target); err != nil {
			t.Fatal(err)
		}
		if ok, err := IsMountPoint(target); err != nil || ok {
			t.Fatalf("after Unmount(%s): IsMountPoint = %v, %v", target, ok, err)
		}
		if err := Unmount(target); err != nil {
			t.Fatalf("second Unmount(%s) = %v, want nil", target, err)
		}
		if _, err := MountInfo(target); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("MountInfo(unmounted) = %v, want ErrNotFound", err)
		}
	}
	if err := Unmount(filepath.Join(t.TempDir(), "missing")); err != nil {
		t.Errorf("Unmount(missing path) = %v, want nil", err)
	}
}

func hasOpt(opts, o string) bool {
	for _, x := range strings.Split(opts, ",") {
		if x == o {
			return true
		}
	}
	return false
}

func TestHostMountErrors(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4")
	dev, _ := newLoop(t, 32*mib)
	if _, err := EnsureFilesystem(context.Background(), dev, Ext4, MkfsOptions{}); err != nil {
		t.Fatal(err)
	}
	err := Mount(dev, filepath.Join(t.TempDir(), "missing"), Ext4, 0, "")
	if !errors.Is(err, errdefs.ErrNotFound) || !errors.Is(err, unix.ENOENT) {
		t.Errorf("mount on a missing target: %v, want ErrNotFound", err)
	}
	mnt := t.TempDir()
	err = Mount(dev, mnt, Ext4, 0, "inode64") // an xfs option
	var me *MountError
	if !errors.As(err, &me) || !errors.Is(err, unix.EINVAL) || !strings.Contains(err.Error(), "inode64") {
		t.Errorf("ext4 with an xfs option: %v, want EINVAL naming the options", err)
	}
	if ok, _ := IsMountPoint(mnt); ok {
		t.Error("failed mount left a mount point")
	}
	if err := Mount(dev, mnt, XFS, 0, ""); err == nil {
		Unmount(mnt)
		t.Error("ext4 mounted as xfs")
	}
	if err := Mount("relative", mnt, Ext4, 0, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("relative source: %v", err)
	}
}

func TestHostUnmountStacked(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	_, _, mnt := mounted(t, Ext4, 32*mib)
	target := t.TempDir()
	for range 3 {
		if err := BindMount(mnt, target, false, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := Unmount(target); err != nil {
		t.Fatal(err)
	}
	if ok, err := IsMountPoint(target); err != nil || ok {
		t.Fatalf("after Unmount of 3 stacked binds: IsMountPoint = %v, %v", ok, err)
	}
}

func TestHostIsMountPointMethodsAgree(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	_, _, mnt := mounted(t, Ext4, 32*mib)
	plain := t.TempDir()
	sub := filepath.Join(mnt, "sub")
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(mnt, link); err != nil {
		t.Fatal(err)
	}
	fileTarget := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(fileTarget, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	srcFile := filepath.Join(mnt, "blockfile")
	if err := os.WriteFile(srcFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := BindMount(srcFile, fileTarget, false, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(fileTarget) })

	want := map[string]bool{"/": true, "/proc": true, mnt: true, fileTarget: true, plain: false, sub: false, link: false, mnt + "/": true}
	methods := mountCheckers()
	for p, w := range want {
		got, err := IsMountPoint(p)
		if err != nil || got != w {
			t.Errorf("IsMountPoint(%s) = %v, %v; want %v", p, got, err, w)
		}
		for name, m := range methods {
			got, err := m(filepath.Clean(p))
			if err != nil || got != w {
				t.Errorf("%s(%s) = %v, %v; want %v", name, p, got, err, w)
			}
		}
	}
	missing := filepath.Join(plain, "missing")
	if _, err := IsMountPoint(missing); !errors.Is(err, errdefs.ErrNotFound) || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("IsMountPoint(missing) = %v, want ErrNotFound and os.ErrNotExist", err)
	}
	for name, m := range methods {
		if _, err := m(missing); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s(missing) = %v, want os.ErrNotExist", name, err)
		}
	}
	if got := mountCheckMethod(); got != viaStatx {
		t.Logf("this kernel uses mount check method %d, not statx", got)
	}
}

func TestHostStatsAndSize(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	const size = 128 * mib
	dev, _, mnt := mounted(t, Ext4, size)
	if n, err := BlockDeviceSize(dev); err != nil || n != size {
		t.Fatalf("BlockDeviceSize = %d, %v; want %d", n, err, size)
	}
	before, err := FilesystemStats(mnt)
	if err != nil {
		t.Fatal(err)
	}
	if before.TotalBytes < size*8/10 || before.TotalBytes > size {
		t.Errorf("TotalBytes %d not within 80-100%% of %d", before.TotalBytes, size)
	}
	if before.AvailableBytes <= 0 || before.AvailableBytes > before.TotalBytes-before.UsedBytes {
		t.Errorf("implausible stats %+v", before)
	}
	if before.TotalInodes <= 0 || before.UsedInodes+before.FreeInodes != before.TotalInodes {
		t.Errorf("inode counts inconsistent: %+v", before)
	}

	data := make([]byte, 8*mib)
	rand.Read(data)
	f, err := os.Create(filepath.Join(mnt, "data"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for i := range 100 {
		if err := os.WriteFile(filepath.Join(mnt, fmt.Sprintf("f%d", i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	after, err := FilesystemStats(mnt)
	if err != nil {
		t.Fatal(err)
	}
	if d := after.UsedBytes - before.UsedBytes; d < 8*mib || d > 10*mib {
		t.Errorf("UsedBytes grew by %d after writing 8 MiB", d)
	}
	if d := after.UsedInodes - before.UsedInodes; d != 101 {
		t.Errorf("UsedInodes grew by %d after creating 101 files", d)
	}
	if err := FlushBuffers(dev); err != nil {
		t.Fatal(err)
	}
	if _, err := BlockDeviceSize(filepath.Join(mnt, "data")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("BlockDeviceSize(regular file) = %v, want ErrInvalidArgument", err)
	}
	if _, err := FilesystemStats(filepath.Join(mnt, "missing")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("FilesystemStats(missing) = %v, want ErrNotFound", err)
	}
}

func TestHostResizeOnline(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	for _, tc := range []struct {
		fsType        string
		size, grownTo int64
		tools         []string
	}{
		{Ext4, 64 * mib, 192 * mib, []string{"resize2fs"}},
		{XFS, 320 * mib, 640 * mib, []string{"xfs_growfs"}},
	} {
		t.Run(tc.fsType, func(t *testing.T) {
			needTools(t, tc.tools...)
			dev, file, mnt := mounted(t, tc.fsType, tc.size)
			before, err := FilesystemStats(mnt)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(file, tc.grownTo); err != nil {
				t.Fatal(err)
			}
			run(t, "losetup", "--set-capacity", dev)
			if n, err := BlockDeviceSize(dev); err != nil || n != tc.grownTo {
				t.Fatalf("BlockDeviceSize after growing = %d, %v; want %d", n, err, tc.grownTo)
			}
			ctx := context.Background()
			err = Resize(ctx, dev, mnt, tc.fsType)
			if tc.fsType == Ext4 && !hasCapability(t, unix.CAP_SYS_RESOURCE) {
				// The kernel refuses EXT4_IOC_RESIZE_FS without
				// CAP_SYS_RESOURCE: the error must say so, and the
				// offline path must still grow the filesystem.
				// A missing capability is permanent: FailedPrecondition,
				// not Unavailable, which the kubelet retries forever.
				if !errors.Is(err, errdefs.ErrFailedPrecondition) || errors.Is(err, errdefs.ErrUnavailable) ||
					!strings.Contains(err.Error(), "CAP_SYS_RESOURCE") || !strings.Contains(err.Error(), "berth doctor") {
					t.Fatalf("online ext4 resize without CAP_SYS_RESOURCE: %v, want ErrFailedPrecondition naming the capability and how to check it", err)
				}
				t.Logf("no CAP_SYS_RESOURCE: online ext4 resize refused as expected (%v); growing offline", err)
				if err := Unmount(mnt); err != nil {
					t.Fatal(err)
				}
				if err := Resize(ctx, dev, "", Ext4); err != nil {
					t.Fatal(err)
				}
				if err := Mount(dev, mnt, Ext4, 0, ""); err != nil {
					t.Fatal(err)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			after, err := FilesystemStats(mnt)
			if err != nil {
				t.Fatal(err)
			}
			grown := after.TotalBytes - before.TotalBytes
			added := tc.grownTo - tc.size
			if grown < added*9/10 || grown > added {
				t.Errorf("TotalBytes %d -> %d: grew by %d, want about %d", before.TotalBytes, after.TotalBytes, grown, added)
			}
			t.Logf("%s: %d -> %d bytes", tc.fsType, before.TotalBytes, after.TotalBytes)
			if err := Resize(ctx, dev, mnt, tc.fsType); err != nil {
				t.Fatalf("second Resize: %v", err)
			}
			if again, _ := FilesystemStats(mnt); again.TotalBytes != after.TotalBytes {
				t.Errorf("second Resize changed the size: %d -> %d", after.TotalBytes, again.TotalBytes)
			}
			other := t.TempDir()
			if err := Resize(ctx, dev, other, tc.fsType); !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("Resize with an unmounted path: %v, want ErrNotFound", err)
			}
		})
	}
}

func TestHostResizeWrongMount(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	_, _, mnt := mounted(t, Ext4, 32*mib)
	otherDev, _ := newLoop(t, 32*mib)
	before, _ := Probe(context.Background(), otherDev)
	if err := Resize(context.Background(), otherDev, mnt, Ext4); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Resize of one device at another's mount: %v, want ErrFailedPrecondition", err)
	}
	if after, _ := Probe(context.Background(), otherDev); after != before {
		t.Fatal("device changed")
	}
}

// hasCapability reports whether the effective capability set holds c.
func hasCapability(t *testing.T, c int) bool {
	t.Helper()
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^CapEff:\s*([0-9a-f]+)$`).FindSubmatch(status)
	if m == nil {
		t.Fatal("no CapEff in /proc/self/status")
	}
	var eff uint64
	if _, err := fmt.Sscanf(string(m[1]), "%x", &eff); err != nil {
		t.Fatal(err)
	}
	return eff&(1<<c) != 0
}

// A device whose content changed under the kernel's buffer cache (here:
// the backing file written directly after the loop device was read) must
// still be probed from the medium.
func TestHostProbeSeesPastStaleCache(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid")
	dev, file := newLoop(t, 16*mib)
	ctx := context.Background()
	// The kernel drops a device's cache at its last close; an open
	// holder (udev, multipathd, another prober) keeps it.
	holder, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if _, err := holder.ReadAt(make([]byte, 64*1024), 0); err != nil {
		t.Fatal(err)
	}
	if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
		t.Fatalf("fresh device: %+v %v", sig, err)
	}
	writeAt(t, file, 0, luks1Header())
	before := hashFile(t, file)
	formatted, err := EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{})
	if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "crypto_LUKS") {
		t.Fatalf("EnsureFilesystem after the header appeared = %v, %v; want refusal naming crypto_LUKS", formatted, err)
	}
	if hashFile(t, file) != before {
		t.Fatal("device bytes changed")
	}
}

// A device whose size is not a whole number of blocks is read to its
// last sector, where several RAID formats keep their signature.
func TestHostProbeLastSectorOfOddSize(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid")
	const size = 64*mib + 512
	file := sparseFile(t, size)
	writeAt(t, file, size-512, []byte("$XIDE$"))
	dev := attachLoop(t, file)
	sig, err := Probe(context.Background(), dev)
	if err != nil || sig.Type != "lsi_mega_raid_member" {
		t.Fatalf("Probe = %+v, %v; want lsi_mega_raid_member", sig, err)
	}
	// EnsureFilesystem's probe sees the same sector.
	before := hashFile(t, file)
	formatted, err := EnsureFilesystem(context.Background(), dev, Ext4, MkfsOptions{})
	if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "lsi_mega_raid_member") {
		t.Fatalf("EnsureFilesystem = %v, %v; want refusal naming lsi_mega_raid_member", formatted, err)
	}
	if hashFile(t, file) != before {
		t.Fatal("device bytes changed")
	}
}

// wipefs clears only the signatures of a filesystem; what remains is
// still data, and Probe still refuses it.
func TestHostProbeAfterWipefs(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4", "wipefs")
	dev, _ := newLoop(t, 64*mib)
	run(t, "/usr/sbin/mkfs.ext4", "-q", "-F", dev)
	run(t, "wipefs", "-a", dev)
	sig, err := Probe(context.Background(), dev)
	if err != nil || sig.Type != typeUnknownData {
		t.Fatalf("Probe after wipefs = %+v, %v; want unknown-data", sig, err)
	}
}

// A device whose first and last MiB, far windows and samples are zero
// is blank without blkid: Probe decides it without running the tool
// (here: no tool can be found). Data in a sample only is refused as
// unknown-data, also without blkid (no libblkid signature can be there).
// Any byte in a window needs blkid.
func TestHostProbeFastPath(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	const size = 64 * mib
	file := sparseFile(t, size)
	dev := attachLoop(t, file)
	ctx := context.Background()
	// The fast path needs to know the node's libblkid, which it learns
	// from blkid once per process.
	if !blkidAudited() {
		t.Fatal("this host's libblkid is newer than the one the far windows were checked against")
	}

	dirs := toolDirs
	toolDirs = []string{t.TempDir()}
	t.Cleanup(func() { toolDirs = dirs })
	t.Setenv("PATH", t.TempDir())
	if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
		t.Fatalf("Probe of a device with zero windows and no blkid = %+v, %v; want blank without blkid", sig, err)
	}
	writeAt(t, file, 3*mib+100, []byte("data outside every window"))
	if sig, err := Probe(ctx, dev); err != nil || sig.Type != typeUnknownData || sig.Offset != 3*mib+100 {
		t.Fatalf("Probe of data in a sample only, without blkid = %+v, %v; want unknown-data at %d", sig, err, 3*mib+100)
	}
	writeAt(t, file, 3*mib+100, make([]byte, 32))
	for _, off := range []int64{0, 4095, mib - 1, 2*mib + 511, 4 * mib, size - 3087*512 + 17, size - mib, size - 1} {
		writeAt(t, file, off, []byte{0x80})
		_, err := Probe(ctx, dev)
		if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "blkid") {
			t.Errorf("Probe with a byte at %d = %v; want it to need blkid", off, err)
		}
		writeAt(t, file, off, []byte{0})
	}
}

func TestHostBindBlockDevice(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dev, _ := newLoop(t, 16*mib)
	target := filepath.Join(t.TempDir(), "block")
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := BindMount(dev, target, false, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Unmount(target); err != nil {
			t.Error(err)
		}
	})
	if n, err := BlockDeviceSize(target); err != nil || n != 16*mib {
		t.Fatalf("BlockDeviceSize(bound device node) = %d, %v; want %d", n, err, 16*mib)
	}
	if ok, err := IsMountPoint(target); err != nil || !ok {
		t.Fatalf("IsMountPoint(bound device node) = %v, %v", ok, err)
	}
}

// The read-only flag of the block layer stops writes that a read-only
// bind mount of the device node lets through.
func TestHostDeviceReadOnly(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	dev, file := newLoop(t, 16*mib)
	t.Cleanup(func() { _ = SetDeviceReadOnly(dev, false) })
	if ro, err := DeviceReadOnly(dev); err != nil || ro {
		t.Fatalf("DeviceReadOnly(fresh loop) = %v, %v; want false", ro, err)
	}
	target := filepath.Join(t.TempDir(), "block")
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := BindMount(dev, target, true, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Unmount(target); err != nil {
			t.Error(err)
		}
	})
	// An fd opened for writing before the flag is set must be stopped too.
	early, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer early.Close()

	if err := SetDeviceReadOnly(dev, true); err != nil {
		t.Fatal(err)
	}
	if err := SetDeviceReadOnly(dev, true); err != nil {
		t.Fatalf("setting read-only twice: %v", err)
	}
	for _, p := range []string{dev, target} {
		if ro, err := DeviceReadOnly(p); err != nil || !ro {
			t.Fatalf("DeviceReadOnly(%s) = %v, %v; want true", p, ro, err)
		}
	}
	before := hashFile(t, file)
	pattern := make([]byte, 4096)
	for i := range pattern {
		pattern[i] = 0xa5
	}
	if f, err := os.OpenFile(target, os.O_WRONLY, 0); err == nil {
		_, werr := f.WriteAt(pattern, 0)
		serr := f.Sync()
		f.Close()
		if werr == nil && serr == nil {
			t.Fatal("write through the read-only device succeeded")
		}
	} else if !errors.Is(err, unix.EACCES) && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EROFS) {
		t.Fatalf("open read-only device for writing: %v, want EACCES, EPERM or EROFS", err)
	}
	if _, err := early.WriteAt(pattern, 0); err == nil {
		if err := early.Sync(); err == nil {
			t.Fatal("write through an fd opened before the flag was set succeeded")
		}
	}
	if hashFile(t, file) != before {
		t.Fatal("device bytes changed while read-only")
	}

	if err := SetDeviceReadOnly(dev, false); err != nil {
		t.Fatal(err)
	}
	if ro, err := DeviceReadOnly(dev); err != nil || ro {
		t.Fatalf("DeviceReadOnly after clearing = %v, %v; want false", ro, err)
	}
	if _, err := early.WriteAt(pattern, 0); err != nil {
		t.Fatalf("write after clearing the flag: %v", err)
	}
	if err := early.Sync(); err != nil {
		t.Fatal(err)
	}

	// Bad input: not a block device, missing.
	if err := SetDeviceReadOnly(file, true); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("SetDeviceReadOnly(regular file) = %v, want ErrInvalidArgument", err)
	}
	if _, err := DeviceReadOnly(filepath.Join(t.TempDir(), "none")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("DeviceReadOnly(missing) = %v, want ErrNotFound", err)
	}
}

// Data between the windows Probe reads for libblkid, on a device whose
// first and last MiB are zero, is found by the samples and refused: the
// layouts of a raw-block database reported formatted over.
func TestHostEnsureFilesystemRefusesDataBetweenWindows(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4")
	const size = 256 * mib
	for _, tc := range []struct {
		name string
		off  int64
		n    int
	}{
		{"4 KiB at 1 MiB + 8 KiB", mib + 8<<10, 4 << 10},
		{"4 KiB at 3 MiB", 3 * mib, 4 << 10},
		{"1 MiB at 64 MiB", 64 * mib, mib},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := sparseFile(t, size)
			b := make([]byte, tc.n)
			rand.Read(b)
			b[0] |= 1 // the first non-zero byte is at tc.off
			writeAt(t, file, tc.off, b)
			dev := attachLoop(t, file)
			before := hashFile(t, file)

			sig, err := Probe(context.Background(), dev)
			if err != nil || sig.Type != typeUnknownData || sig.Offset != tc.off {
				t.Errorf("Probe = %+v, %v; want unknown-data at offset %d", sig, err, tc.off)
			}
			formatted, err := EnsureFilesystem(context.Background(), dev, Ext4, MkfsOptions{})
			if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) {
				t.Fatalf("EnsureFilesystem = %v, %v; want a FAILED_PRECONDITION refusal", formatted, err)
			}
			if want := fmt.Sprintf("offset %d", tc.off); !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not name %q", err, want)
			}
			if hashFile(t, file) != before {
				t.Fatal("device bytes changed")
			}
			t.Logf("refused: %v", err)
		})
	}
}

// BeforeMkfs runs only for a blank device, before mkfs, and its error
// stops the format; Format makes the filesystem over partial writes that
// EnsureFilesystem refuses.
func TestHostBeforeMkfsAndFormat(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4")
	ctx := context.Background()
	dev, file := newLoop(t, 64*mib)
	calls := 0
	stop := errors.New("record failed")
	_, err := EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{BeforeMkfs: func() error { calls++; return stop }})
	if !errors.Is(err, stop) || calls != 1 {
		t.Fatalf("EnsureFilesystem with a failing BeforeMkfs = %v after %d calls", err, calls)
	}
	if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
		t.Fatalf("device after a stopped format: %+v, %v", sig, err)
	}

	junk := make([]byte, 4096)
	rand.Read(junk)
	junk[0] |= 1
	writeAt(t, file, 4096, junk)
	before := hashFile(t, file)
	_, err = EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{BeforeMkfs: func() error { calls++; return nil }})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || calls != 1 || hashFile(t, file) != before {
		t.Fatalf("EnsureFilesystem over partial writes = %v, BeforeMkfs called %d times", err, calls)
	}
	if err := Format(ctx, dev, Ext4, MkfsOptions{}); err != nil {
		t.Fatalf("Format: %v", err)
	}
	formatted, err := EnsureFilesystem(ctx, dev, Ext4, MkfsOptions{BeforeMkfs: func() error { calls++; return nil }})
	if err != nil || formatted || calls != 1 {
		t.Fatalf("EnsureFilesystem after Format = %v, %v, BeforeMkfs called %d times; want the ext4 used as it is", formatted, err, calls)
	}
}

// imageOf is MkfsOptions.Image for a loop device on file, as
// devices.LoopBackingFile gives it.
func imageOf(file string, size int64) func() (*os.File, int64, error) {
	return func() (*os.File, int64, error) {
		f, err := os.Open(file)
		return f, size, err
	}
}

// logTo returns ctx with a logger that writes to b.
func logTo(ctx context.Context, b *bytes.Buffer) context.Context {
	return logctx.With(ctx, slog.New(slog.NewTextHandler(b, nil)))
}

// With the image a loop device shows, EnsureFilesystem reads the
// image's data: data between the probe's samples is refused at its
// offset, a filesystem in the image is used as it is, and an image of
// zeros is formatted, also when it holds more than the bound (then the
// device is probed instead, and the log says so). When the image cannot
// be had, the device is probed.
func TestHostEnsureFilesystemImage(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.ext4")
	ctx := context.Background()
	const size = 64 * mib
	dev, file := newLoop(t, size)
	// Samples are 16 KiB every 2 MiB of a 64 MiB device.
	const off = 41*mib + 100<<10
	writeAt(t, file, off, []byte("data"))
	if sig, err := Probe(ctx, dev); err != nil || !sig.Blank() {
		t.Fatalf("Probe = %+v, %v; want the data missed", sig, err)
	}
	before := hashFile(t, file)
	var log bytes.Buffer
	formatted, err := EnsureFilesystem(logTo(ctx, &log), dev, Ext4, MkfsOptions{Image: imageOf(file, size)})
	if formatted || !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), fmt.Sprintf("byte read at offset %d)", off)) {
		t.Fatalf("EnsureFilesystem over data at %d = %v, %v; want a FAILED_PRECONDITION refusal naming the offset", off, formatted, err)
	}
	if hashFile(t, file) != before || log.Len() != 0 {
		t.Fatalf("device bytes changed, or the log says %q", log.String())
	}

	// Zeros written over the data, more than the bound: probed, blank.
	defer func(b int64) { imageReadBound = b }(imageReadBound)
	imageReadBound = 8 * mib
	writeAt(t, file, 40*mib, make([]byte, 9*mib))
	formatted, err = EnsureFilesystem(logTo(ctx, &log), dev, Ext4, MkfsOptions{Image: imageOf(file, size)})
	if err != nil || !formatted {
		t.Fatalf("EnsureFilesystem over 9 MiB of zeros, bound 8 MiB = %v, %v; want formatted", formatted, err)
	}
	if !strings.Contains(log.String(), "probed and sampled instead") || !strings.Contains(log.String(), "more than 8388608 bytes") {
		t.Fatalf("the log does not say the image was sampled instead: %q", log.String())
	}
	log.Reset()
	formatted, err = EnsureFilesystem(logTo(ctx, &log), dev, Ext4, MkfsOptions{Image: imageOf(file, size)})
	if err != nil || formatted || log.Len() != 0 {
		t.Fatalf("EnsureFilesystem of the image's ext4 = %v, %v, log %q; want it used as it is", formatted, err, log.String())
	}

	// The image cannot be had: the probe decides, and refuses data.
	junk := make([]byte, 4096)
	rand.Read(junk)
	junk[0] |= 1
	writeAt(t, file, 0, junk)
	before = hashFile(t, file)
	for name, image := range map[string]func() (*os.File, int64, error){
		"no file":  func() (*os.File, int64, error) { return nil, 0, nil },
		"an error": func() (*os.File, int64, error) { return nil, 0, errors.New("cannot tell") },
	} {
		log.Reset()
		_, err := EnsureFilesystem(logTo(ctx, &log), dev, Ext4, MkfsOptions{Image: image})
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || hashFile(t, file) != before || !strings.Contains(log.String(), "probed and sampled instead") {
			t.Fatalf("%s: EnsureFilesystem over data = %v, log %q; want it refused by the probe, and logged", name, err, log.String())
		}
	}
}

// An image without data is formatted: its reads find none.
func TestHostEnsureFilesystemSparseImage(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mount")
	needTools(t, "blkid", "mkfs.xfs")
	const size = 512 * mib
	dev, file := newLoop(t, size)
	var log bytes.Buffer
	formatted, err := EnsureFilesystem(logTo(context.Background(), &log), dev, XFS, MkfsOptions{Image: imageOf(file, size)})
	if err != nil || !formatted || log.Len() != 0 {
		t.Fatalf("EnsureFilesystem of a sparse image = %v, %v, log %q; want formatted", formatted, err, log.String())
	}
}
