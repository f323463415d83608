package iscsi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/lockfile"
)

// runner runs a tool with an argument vector and returns its standard
// output. A failure is a *command.Error carrying the exit code, the
// tool's messages and, for iscsiadm's exit codes, their meaning and
// sentinel.
type runner interface {
	run(ctx context.Context, name string, args ...string) ([]byte, error)
}

type execRunner struct{}

// recordsRunner runs iscsiadm commands so that none walks open-iscsi's
// node records while another changes them. iscsiadm takes open-iscsi's
// database lock only to write: a command that walks the record tree
// (a login, a delete: both look for every record that matches) fails
// with exit 6, "iface iter could not stat", when another target's record
// is removed under it, as happens when two volumes of one array are
// staged and unstaged at once. Commands that create or delete records,
// and berth's own record edits (recordDB.lock), hold walks exclusively;
// the others share it. The wait is as long as the commands ahead of it,
// each bounded by its own request's context.
type recordsRunner struct {
	runner
	iscsiadm string
	walks    *recordWalks
}

func (r recordsRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	if name != r.iscsiadm {
		return r.runner.run(ctx, name, args...)
	}
	release, err := r.walks.hold(changesRecords(args))
	if err != nil {
		return nil, err
	}
	defer release()
	return r.runner.run(ctx, name, args...)
}

// recordWalks orders walks and changes of open-iscsi's node records on
// the whole node, as the records are the node's: an flock(2) on
// walksLockName in open-iscsi's lock directory, shared to walk, exclusive
// to change. Every berth on the node takes it there (two instances, each
// with a state directory of its own, stage and unstage volumes of one
// array at once), and each hold is an open file of its own, so that one
// berth's commands order against each other in the same way.
type recordWalks struct {
	dir string // open-iscsi's lock directory
}

const walksLockName = "berth.walks"

func (w *recordWalks) hold(exclusive bool) (release func(), err error) {
	l, err := w.lockIn(walksLockName, exclusive)
	if err != nil {
		return nil, fmt.Errorf("order iscsiadm's walks of the node records: %w", err)
	}
	return func() { l.Close() }, nil
}

// lockIn takes the lock file name in open-iscsi's lock directory (see
// lockfile.Wait), where berth's node-wide locks live.
func (w *recordWalks) lockIn(name string, exclusive bool) (*lockfile.Lock, error) {
	if err := w.mkdir(); err != nil {
		return nil, err
	}
	return lockfile.Wait(filepath.Join(w.dir, name), exclusive)
}

// lockInContext takes the lock file name in open-iscsi's lock directory
// exclusively, as lockIn does, waiting no longer than ctx.
func (w *recordWalks) lockInContext(ctx context.Context, name string) (*lockfile.Lock, error) {
	if err := w.mkdir(); err != nil {
		return nil, err
	}
	return lockfile.WaitContext(ctx, filepath.Join(w.dir, name))
}

func (w *recordWalks) mkdir() error {
	if err := os.MkdirAll(w.dir, 0o700); err != nil {
		return fmt.Errorf("open-iscsi lock directory %s: %w", w.dir, err)
	}
	return nil
}

// changesRecords reports whether an iscsiadm command line adds, deletes
// or rewrites records: node or discovery records (-o new, delete, update)
// or a discovery, which writes the discovered targets.
func changesRecords(args []string) bool {
	for i, a := range args {
		switch a {
		case "--discover":
			return true
		case "-o", "--op":
			if i+1 < len(args) && args[i+1] != "show" && args[i+1] != "nonpersistent" {
				return true
			}
		}
	}
	return false
}

var _ runner = execRunner{}

func (execRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	out, err := command.Run(ctx, command.Cmd{
		Path: name,
		Args: args,
		// iscsiadm (or the wrapper --iscsiadm names, which may need
		// berth's PATH to find nsenter or chroot) runs in berth's
		// environment.
		Env: os.Environ(),
		// A wrapper that forks (nsenter, chroot) may leave a child holding
		// the pipes after the context killed it.
		WaitDelay: 2 * time.Second,
	})
	var ce *command.Error
	if errors.As(err, &ce) && ce.ExitCode >= 0 {
		ce.Kind = sentinelForExit(ce.ExitCode)
		ce.Meaning = exitMeaning(ce.ExitCode)
	}
	return out, err
}

// Argument vectors for iscsiadm. None of them ever holds a credential:
// those go into the record files (record.go).

// portalArg is the -p argument: ip:port, with ",tpgt" when known.
func portalArg(ip string, port, tpgt int) string {
	s := net.JoinHostPort(ip, strconv.Itoa(port))
	if tpgt >= 0 {
		s += "," + strconv.Itoa(tpgt)
	}
	return s
}

func argsNodeNew(target, ip string, port, tpgt int, iface string) []string {
	return []string{"-m", "node", "-o", "new", "-T", target, "-p", portalArg(ip, port, tpgt), "-I", iface}
}

func argsNodeLogin(target, ip string, port, tpgt int, iface string) []string {
	return []string{"-m", "node", "-T", target, "-p", portalArg(ip, port, tpgt), "-I", iface, "--login"}
}

func argsNodeDelete(target, ip string, port int, iface string) []string {
	return []string{"-m", "node", "-o", "delete", "-T", target, "-p", portalArg(ip, port, -1), "-I", iface}
}

func argsSessionLogout(sid int) []string {
	return []string{"-m", "session", "-r", strconv.Itoa(sid), "-u"}
}

func argsDiscoveryNew(ip string, port int, iface string) []string {
	return []string{"-m", "discoverydb", "-t", "sendtargets", "-p", portalArg(ip, port, -1), "-I", iface, "-o", "new"}
}

func argsDiscover(ip string, port int, iface string) []string {
	return []string{"-m", "discoverydb", "-t", "sendtargets", "-p", portalArg(ip, port, -1), "-I", iface, "--discover", "-o", "nonpersistent"}
}

func argsDiscoveryDelete(ip string, port int) []string {
	return []string{"-m", "discoverydb", "-t", "sendtargets", "-p", portalArg(ip, port, -1), "-o", "delete"}
}
