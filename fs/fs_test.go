package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
)

func TestMkfsArgs(t *testing.T) {
	for _, tc := range []struct {
		fsType string
		opt    MkfsOptions
		want   []string
	}{
		{Ext4, MkfsOptions{}, []string{"-t", "ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "--", "/dev/x"}},
		{Ext4, MkfsOptions{Label: "vol1", ExtraArgs: []string{"-b", "4096", "-m0", "-O", "^has_journal"}},
			[]string{"-t", "ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "-L", "vol1", "-b", "4096", "-m0", "-O", "^has_journal", "--", "/dev/x"}},
		{XFS, MkfsOptions{}, []string{"-q", "-f", "-K", "--", "/dev/x"}},
		{XFS, MkfsOptions{Label: "twelve_chars", ExtraArgs: []string{"-m", "reflink=1", "-q"}}, []string{"-q", "-f", "-K", "-L", "twelve_chars", "-m", "reflink=1", "-q", "--", "/dev/x"}},
	} {
		got, err := mkfsArgs(tc.fsType, "/dev/x", tc.opt)
		if err != nil {
			t.Errorf("%s %+v: %v", tc.fsType, tc.opt, err)
			continue
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s %+v:\n got %q\nwant %q", tc.fsType, tc.opt, got, tc.want)
		}
	}
}

func TestMkfsArgsRefused(t *testing.T) {
	for _, tc := range []struct {
		fsType string
		opt    MkfsOptions
	}{
		{"btrfs", MkfsOptions{}},
		{"", MkfsOptions{}},
		{"ext3", MkfsOptions{}},
		{Ext4, MkfsOptions{Label: "seventeen_chars_x"}},
		{XFS, MkfsOptions{Label: "thirteen_char"}},
		{Ext4, MkfsOptions{Label: "-F"}},
		{Ext4, MkfsOptions{Label: "a\nb"}},
		{Ext4, MkfsOptions{Label: "\xff"}},
		{Ext4, MkfsOptions{ExtraArgs: []string{"/dev/sda"}}},          // positional: another device
		{Ext4, MkfsOptions{ExtraArgs: []string{"-b"}}},                // missing value
		{Ext4, MkfsOptions{ExtraArgs: []string{"-F"}}},                // force
		{Ext4, MkfsOptions{ExtraArgs: []string{"-n"}}},                // dry run flag not allowed
		{Ext4, MkfsOptions{ExtraArgs: []string{"-S"}}},                // superblock-only rewrite
		{Ext4, MkfsOptions{ExtraArgs: []string{"-t", "ext2"}}},        // type is ours
		{Ext4, MkfsOptions{ExtraArgs: []string{"-d", "/etc"}}},        // populate from a directory
		{Ext4, MkfsOptions{ExtraArgs: []string{"-jF"}}},               // combined flags
		{Ext4, MkfsOptions{ExtraArgs: []string{"--", "/dev/sda"}}},    // end of options
		{Ext4, MkfsOptions{ExtraArgs: []string{"-b", "4096\n-F"}}},    // newline in value
		{Ext4, MkfsOptions{ExtraArgs: []string{"-b", ""}}},            // empty value
		{XFS, MkfsOptions{ExtraArgs: []string{"-f"}}},                 // force
		{XFS, MkfsOptions{ExtraArgs: []string{"-N"}}},                 // dry run
		{XFS, MkfsOptions{ExtraArgs: []string{"-p", "/tmp/proto"}}},   // prototype file
		{XFS, MkfsOptions{ExtraArgs: []string{"-d", "file=1", "/x"}}}, // trailing positional
	} {
		if args, err := mkfsArgs(tc.fsType, "/dev/x", tc.opt); err == nil {
			t.Errorf("%q %+v accepted: %q", tc.fsType, tc.opt, args)
		} else if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q %+v: %v does not wrap ErrInvalidArgument", tc.fsType, tc.opt, err)
		}
	}
}

func TestSupportedFsTypes(t *testing.T) {
	got := SupportedFsTypes()
	if !slices.Equal(got, []string{"ext4", "xfs"}) {
		t.Fatalf("SupportedFsTypes() = %q", got)
	}
	for _, fs := range got {
		if err := checkFsType(fs); err != nil {
			t.Error(err)
		}
	}
}

func TestFsckResult(t *testing.T) {
	te := func(code int) error {
		return &command.Error{Args: []string{"e2fsck", "-p", "/dev/x"}, ExitCode: code, Output: "stderr text"}
	}
	for _, tc := range []struct {
		code         int
		ok           bool
		precondition bool
	}{
		{fsckCorrected, true, false},
		{fsckCorrectedReboot, true, false},
		{fsckCorrected | fsckCorrectedReboot, true, false},
		{fsckUncorrected, false, true},
		{fsckUncorrected | fsckCorrected, false, true},
		{fsckOperationalError, false, false},
		{fsckOperationalError | fsckUncorrected, false, false},
		{fsckUsageError, false, false},
		{fsckCancelled, false, false},
		{fsckSharedLibraryError, false, false},
	} {
		err := fsckResult("/dev/x", te(tc.code))
		if (err == nil) != tc.ok {
			t.Errorf("exit %d: err = %v, want ok=%v", tc.code, err, tc.ok)
			continue
		}
		if err == nil {
			continue
		}
		if got := errors.Is(err, errdefs.ErrFailedPrecondition); got != tc.precondition {
			t.Errorf("exit %d: ErrFailedPrecondition = %v, want %v (%v)", tc.code, got, tc.precondition, err)
		}
		if !strings.Contains(err.Error(), "stderr text") || !strings.Contains(err.Error(), "/dev/x") {
			t.Errorf("exit %d: error %q lacks the device or e2fsck's output", tc.code, err)
		}
	}
	if err := fsckResult("/dev/x", nil); err != nil {
		t.Errorf("exit 0: %v", err)
	}
}

func TestRunToolError(t *testing.T) {
	// ls of a missing file writes to stderr and exits 2.
	_, err := runTool(context.Background(), "ls", "/nonexistent-berth-path")
	var te *command.Error
	if !errors.As(err, &te) {
		t.Fatalf("got %v, want *command.Error", err)
	}
	if te.ExitCode != 2 || !strings.Contains(te.Output, "nonexistent-berth-path") {
		t.Errorf("got exit %d stderr %q", te.ExitCode, te.Output)
	}
	if !strings.Contains(err.Error(), "exit status 2") || !strings.Contains(err.Error(), "No such file") {
		t.Errorf("error text %q lacks the exit status or stderr", err)
	}
	te.Kind = errdefs.ErrFailedPrecondition
	if !errors.Is(te, errdefs.ErrFailedPrecondition) {
		t.Error("Kind not matched by errors.Is")
	}
	if _, err := runTool(context.Background(), "berth-no-such-tool"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("missing tool: %v, want ErrUnavailable", err)
	}
}

func TestLookToolSkipsBusybox(t *testing.T) {
	bb := t.TempDir()
	real := t.TempDir()
	if err := os.WriteFile(filepath.Join(bb, "busybox"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("busybox", filepath.Join(bb, "mkfs.berthtest")); err != nil {
		t.Fatal(err)
	}
	old := toolDirs
	t.Cleanup(func() { toolDirs = old })
	t.Setenv("PATH", "")

	toolDirs = []string{bb}
	if _, err := lookTool("mkfs.berthtest"); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "busybox") {
		t.Errorf("only busybox: got %v", err)
	}
	want := filepath.Join(real, "mkfs.berthtest")
	if err := os.WriteFile(want, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	toolDirs = []string{bb, real}
	if got, err := lookTool("mkfs.berthtest"); err != nil || got != want {
		t.Errorf("got %q %v, want %q", got, err, want)
	}
}

func TestAcquireHeavyHonoursContext(t *testing.T) {
	var releases []func()
	for range cap(heavy) {
		r, err := acquireHeavy(context.Background(), "test")
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, r)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := acquireHeavy(ctx, "format /dev/x"); !errors.Is(err, context.Canceled) {
		t.Errorf("full semaphore, cancelled ctx: got %v", err)
	}
	for _, r := range releases {
		r()
	}
	if len(heavy) != 0 {
		t.Fatalf("%d slots still held after release", len(heavy))
	}
	r, err := acquireHeavy(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	r()
}

// A burst of stages (a node's pods started at once) formats or checks
// its volumes together, as the tools run by hand would: on any node 32
// mkfs/fsck runs start without waiting for each other.
func TestHeavyBurstDoesNotWait(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	var releases []func()
	defer func() {
		for _, r := range releases {
			r()
		}
	}()
	for i := range 32 {
		r, err := acquireHeavy(ctx, fmt.Sprintf("format %d", i))
		if err != nil {
			t.Fatalf("heavy run %d of a burst of 32 on %d CPUs had to wait: %v", i+1, runtime.NumCPU(), err)
		}
		releases = append(releases, r)
	}
}
