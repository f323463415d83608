package fs

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
)

// heavy bounds the mkfs, fsck and resize runs of this process: 8 per
// CPU, at least 32. With lazy initialisation mkfs, like fsck of a clean
// filesystem, spends most of its time waiting for the device, so a burst
// of stages (a node's pods started at once) runs its tools together, as
// an administrator's script would; fewer slots than that (2 per CPU
// before) made a burst of 32 stages on 2 cores queue for mkfs in 8 waves
// while the CPUs waited. The bound stays for bursts of hundreds.
var heavy = make(chan struct{}, max(32, 8*runtime.NumCPU()))

// acquireHeavy takes a slot for a heavy tool run; release it with the
// returned function.
func acquireHeavy(ctx context.Context, what string) (release func(), err error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	select {
	case heavy <- struct{}{}:
		return func() { <-heavy }, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("%s: waiting for a free mkfs/fsck/resize slot: %w", what, ctx.Err())
	}
}

// toolDirs are searched before $PATH: on minimal systems $PATH may lead to
// busybox applets whose mkfs/blkid lack the options used here.
var toolDirs = []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"}

// lookTool finds the real (non-busybox) executable for name: the first
// in toolDirs, else the one $PATH gives.
func lookTool(name string) (string, error) {
	var busybox []string
	usable := func(c string) bool {
		fi, err := os.Stat(c)
		if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			return false
		}
		if isBusybox(c) {
			busybox = append(busybox, c)
			return false
		}
		return true
	}
	for _, d := range toolDirs {
		if c := filepath.Join(d, name); usable(c) {
			return c, nil
		}
	}
	// $PATH is searched only when no tool directory has the tool.
	if p, err := exec.LookPath(name); err == nil && usable(p) {
		return p, nil
	}
	if len(busybox) > 0 {
		return "", fmt.Errorf("look up %s: only busybox applets found (%s); install the real tool (e2fsprogs, xfsprogs, util-linux): %w",
			name, strings.Join(busybox, ", "), errdefs.ErrUnavailable)
	}
	return "", fmt.Errorf("look up %s: not found in %s or $PATH; install e2fsprogs, xfsprogs and util-linux: %w",
		name, strings.Join(toolDirs, ", "), errdefs.ErrUnavailable)
}

// isBusybox reports whether path is (a link to) busybox.
func isBusybox(path string) bool {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return false
	}
	return strings.HasPrefix(filepath.Base(real), "busybox")
}

// runTool runs name with args and returns its standard output. A failed
// run is a *command.Error, with ExitCode set for a non-zero exit.
func runTool(ctx context.Context, name string, args ...string) (stdout []byte, err error) {
	return runToolInput(ctx, nil, name, args...)
}

// runToolInput is runTool with stdin given to the tool on its standard
// input, through a pipe (a secret the tool reads there is in no argument,
// environment variable or file).
func runToolInput(ctx context.Context, stdin []byte, name string, args ...string) (stdout []byte, err error) {
	path, err := lookTool(name)
	if err != nil {
		return nil, err
	}
	return command.Run(ctx, command.Cmd{
		Path: path,
		Name: name,
		Args: args,
		// A fixed locale keeps tool messages stable for operators and tests.
		Env:   []string{"LC_ALL=C", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"},
		Stdin: stdin,
		// After a kill on ctx end, do not wait forever for a grandchild
		// holding the output pipes.
		WaitDelay: 5 * time.Second,
		// While the tool runs: a crash here leaves, say, half a mkfs.
		Started: func() { failpoint.Hit("exec." + name) },
	})
}
