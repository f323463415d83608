package iscsi

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os/exec"
	"strconv"
	"time"
)

// runner runs a tool with an argument vector and returns its standard
// output. A failure is a *CommandError carrying the exit code and the
// tool's messages.
type runner interface {
	run(ctx context.Context, name string, args ...string) ([]byte, error)
}

type execRunner struct{}

var _ runner = execRunner{}

func (execRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// A wrapper that forks (nsenter, chroot) may leave a child holding the
	// pipes after the context killed it.
	cmd.WaitDelay = 2 * time.Second
	err := cmd.Run()
	if err == nil {
		return stdout.Bytes(), nil
	}
	ce := &CommandError{Args: append([]string{name}, args...), ExitCode: -1, Output: stderr.String()}
	if ce.Output == "" {
		ce.Output = stdout.String()
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.Exited() {
		ce.ExitCode = ee.ExitCode()
		ce.Err = sentinelForExit(ce.ExitCode)
	} else {
		ce.Err = err
	}
	if ctx.Err() != nil {
		ce.Err = errors.Join(ce.Err, ctx.Err())
	}
	return stdout.Bytes(), ce
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
