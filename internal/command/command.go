// Package command runs external programs for berth's packages: one
// argument vector, never a shell or a command string; an environment and
// standard input the caller chooses; and on failure one error type,
// *Error, that carries the exit code and what the program wrote. Policy
// stays with the callers: which binary to run, how many may run at once,
// and what an exit code means.
package command

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// MaxOutput caps how much of a program's output goes into an Error: its
// last MaxOutput bytes, where programs print their verdict.
const MaxOutput = 4096

// Cmd is one run of a program.
type Cmd struct {
	// Path is the program to run: a path, or a name looked up in $PATH.
	Path string
	// Name is how errors name the program (argument 0 of Error.Args);
	// Path when empty.
	Name string
	// Args are the arguments, without the program. They appear in
	// errors and logs: never put a secret here, give it on Stdin.
	Args []string
	// Env is the program's complete environment; nil passes berth's own.
	Env []string
	// Stdin, when not nil, is written to the program's standard input
	// through a pipe (a secret read there is in no argument, environment
	// variable or file). When nil the program reads /dev/null.
	Stdin []byte
	// WaitDelay bounds the wait for the output pipes after the program
	// was killed on ctx's end or exited: a child it forked (a wrapper's
	// nsenter, a daemonising helper) may hold them open. 0 waits for ever.
	WaitDelay time.Duration
	// Started, when set, is called once the program runs, before the wait
	// for its end (a fault-injection point "while mkfs writes").
	Started func()
}

// Run runs c and returns the program's standard output. A program that
// fails to start, exits non-zero or is killed gives an *Error; the output
// it wrote is returned all the same.
func Run(ctx context.Context, c Cmd) (stdout []byte, err error) {
	cmd := exec.CommandContext(ctx, c.Path, c.Args...)
	cmd.Env = c.Env
	var out, errb bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &errb
	if c.Stdin != nil {
		cmd.Stdin = bytes.NewReader(c.Stdin)
	}
	cmd.WaitDelay = c.WaitDelay
	runErr := cmd.Start()
	if runErr == nil {
		if c.Started != nil {
			c.Started()
		}
		runErr = cmd.Wait()
	}
	if runErr == nil {
		return out.Bytes(), nil
	}
	name := c.Name
	if name == "" {
		name = c.Path
	}
	e := &Error{
		Args:     append([]string{name}, c.Args...),
		ExitCode: -1,
		Output:   tail(errb.String(), MaxOutput),
		Err:      runErr,
	}
	if e.Output == "" {
		e.Output = tail(out.String(), MaxOutput)
	}
	var ee *exec.ExitError
	if errors.As(runErr, &ee) && ee.Exited() {
		e.ExitCode = ee.ExitCode()
	}
	if ctx.Err() != nil {
		e.Err = fmt.Errorf("%w (%w)", runErr, ctx.Err())
	}
	return out.Bytes(), e
}

// Error is a failed run of a program. Its message holds the argument
// vector, the exit status and the program's own words, which is what an
// operator needs to act on.
type Error struct {
	// Args is the argument vector, the program's name first. It never
	// holds a secret (see Cmd.Args).
	Args []string
	// ExitCode is the program's exit status, or -1 when it did not
	// start or did not exit normally (killed by a signal or on ctx's end).
	ExitCode int
	// Output is the tail of the program's standard error, or of its
	// standard output when it wrote nothing to standard error.
	Output string
	// Err is the start or wait error (an *exec.ExitError for a non-zero
	// exit), joined with the context's error when ctx ended.
	Err error
	// Kind is an errdefs sentinel the caller attached for this exit code,
	// or nil.
	Kind error
	// Meaning names the exit code for the operator ("CHAP authentication
	// failed"), or is empty; the caller sets it.
	Meaning string
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(strings.Join(e.Args, " "))
	if e.ExitCode >= 0 {
		fmt.Fprintf(&b, ": exit status %d", e.ExitCode)
		if e.Meaning != "" {
			fmt.Fprintf(&b, " (%s)", e.Meaning)
		}
	}
	// The exit error only repeats "exit status N"; anything else (a
	// start error, a kill, the context's end) is news.
	if _, exitOnly := e.Err.(*exec.ExitError); e.Err != nil && (!exitOnly || e.ExitCode < 0) {
		fmt.Fprintf(&b, ": %v", e.Err)
	}
	if s := strings.TrimSpace(e.Output); s != "" {
		b.WriteString(": " + s)
	}
	return b.String()
}

// Unwrap returns the run error and the sentinel kind, those that are set.
func (e *Error) Unwrap() []error {
	var errs []error
	for _, err := range []error{e.Err, e.Kind} {
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// ExitCode returns the exit code of the *Error in err's chain, or -1 when
// there is none or the program did not exit normally.
func ExitCode(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.ExitCode
	}
	return -1
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
