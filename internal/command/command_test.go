package command

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
)

// script writes an executable shell script and returns its path.
func script(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tool")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRunStdout(t *testing.T) {
	out, err := Run(context.Background(), Cmd{Path: script(t, `printf '%s|' "$@"; echo "$LC_ALL"`), Args: []string{"a b", "-c"}, Env: []string{"LC_ALL=C"}})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(out), "a b|-c|C\n"; got != want {
		t.Errorf("stdout %q, want %q (arguments passed one by one, the given environment)", got, want)
	}
}

func TestRunExitCode(t *testing.T) {
	p := script(t, "echo partial; echo 'no such device' >&2; exit 3\n")
	out, err := Run(context.Background(), Cmd{Path: p, Name: "mkfs.test", Args: []string{"-q", "/dev/x"}})
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v, want *Error", err)
	}
	if e.ExitCode != 3 || ExitCode(err) != 3 {
		t.Errorf("exit code %d (ExitCode %d), want 3", e.ExitCode, ExitCode(err))
	}
	if string(out) != "partial\n" {
		t.Errorf("stdout %q, want the output written before the failure", out)
	}
	if want := []string{"mkfs.test", "-q", "/dev/x"}; strings.Join(e.Args, " ") != strings.Join(want, " ") {
		t.Errorf("Args %q, want %q", e.Args, want)
	}
	if got, want := err.Error(), "mkfs.test -q /dev/x: exit status 3: no such device"; got != want {
		t.Errorf("message %q, want %q", got, want)
	}
	e.Meaning = "device missing"
	if got, want := err.Error(), "mkfs.test -q /dev/x: exit status 3 (device missing): no such device"; got != want {
		t.Errorf("message %q, want %q", got, want)
	}
	if ExitCode(errors.New("other")) != -1 {
		t.Error("ExitCode of a foreign error is not -1")
	}
}

// A tool that writes its verdict to standard output gets that into the
// error when its standard error is empty.
func TestRunStdoutWhenNoStderr(t *testing.T) {
	_, err := Run(context.Background(), Cmd{Path: script(t, "echo 'iscsiadm: No session found.'; exit 21\n")})
	if !strings.Contains(err.Error(), "No session found.") {
		t.Errorf("message %q lacks the standard output", err)
	}
}

func TestRunOutputTail(t *testing.T) {
	// 100000 'x' then a last line: the error keeps the end.
	p := script(t, "head -c 100000 /dev/zero | tr '\\0' x >&2; echo LAST >&2; exit 1\n")
	_, err := Run(context.Background(), Cmd{Path: p})
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v", err)
	}
	if len(e.Output) > MaxOutput+3 || !strings.HasPrefix(e.Output, "...") || !strings.HasSuffix(e.Output, "LAST\n") {
		t.Errorf("output of %d bytes, starting %q, ending %q: want the last %d bytes", len(e.Output), e.Output[:min(10, len(e.Output))], e.Output[max(0, len(e.Output)-10):], MaxOutput)
	}
	if len(err.Error()) > MaxOutput+200 {
		t.Errorf("message of %d bytes", len(err.Error()))
	}
}

// Stdin reaches the program through a pipe and appears in neither the
// argument vector nor the error.
func TestRunStdin(t *testing.T) {
	secret := "s3cret-passphrase"
	seen := filepath.Join(t.TempDir(), "seen")
	p := script(t, `cat > "$1"; echo "$0 $*" >&2; exit 2`+"\n")
	_, err := Run(context.Background(), Cmd{Path: p, Name: "cryptsetup", Args: []string{seen}, Stdin: []byte(secret)})
	var e *Error
	if !errors.As(err, &e) || e.ExitCode != 2 {
		t.Fatalf("got %v, want exit status 2", err)
	}
	got, rerr := os.ReadFile(seen)
	if rerr != nil {
		t.Fatal(rerr)
	}
	if string(got) != secret {
		t.Errorf("standard input %q, want %q", got, secret)
	}
	if strings.Contains(err.Error(), secret) || strings.Contains(strings.Join(e.Args, " "), secret) || strings.Contains(e.Output, secret) {
		t.Errorf("the secret leaked into the error: %v", err)
	}

	// Without Stdin the program reads an empty input, not berth's own.
	out, err := Run(context.Background(), Cmd{Path: script(t, "wc -c\n")})
	if err != nil || strings.TrimSpace(string(out)) != "0" {
		t.Errorf("without Stdin: %q, %v", out, err)
	}
}

func TestRunContextCancel(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := Run(ctx, Cmd{Path: script(t, "exec sleep 30\n"), WaitDelay: time.Second})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want context.DeadlineExceeded", err)
	}
	if ExitCode(err) != -1 {
		t.Errorf("exit code %d of a killed program, want -1", ExitCode(err))
	}
	if !strings.Contains(err.Error(), "context deadline exceeded") {
		t.Errorf("message %q does not say the context ended", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Run returned after %v", d)
	}
}

// A grandchild that keeps the output pipes open does not hold Run past
// WaitDelay once the context ended.
func TestRunWaitDelay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := Run(ctx, Cmd{Path: script(t, "sleep 30 & wait\n"), WaitDelay: 300 * time.Millisecond})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Run returned after %v, want about ctx timeout + WaitDelay", d)
	}
}

func TestRunStartError(t *testing.T) {
	_, err := Run(context.Background(), Cmd{Path: filepath.Join(t.TempDir(), "missing"), Args: []string{"-m", "node"}})
	var e *Error
	if !errors.As(err, &e) || e.ExitCode != -1 {
		t.Fatalf("got %v, want *Error with exit code -1", err)
	}
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("message %q or chain lacks the start error", err)
	}
}

func TestRunStarted(t *testing.T) {
	p := script(t, "cat\n")
	called := false
	out, err := Run(context.Background(), Cmd{Path: p, Stdin: []byte("x"), Started: func() { called = true }})
	if err != nil || !called || string(out) != "x" {
		t.Errorf("Started called %v, output %q, error %v", called, out, err)
	}
}

func TestErrorKind(t *testing.T) {
	_, err := Run(context.Background(), Cmd{Path: script(t, "exit 4\n")})
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v", err)
	}
	if errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Error("an error without Kind matches a sentinel")
	}
	e.Kind = errdefs.ErrFailedPrecondition
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Error("Kind not matched by errors.Is")
	}
	var ee interface{ ExitCode() int }
	if !errors.As(err, &ee) || ee.ExitCode() != 4 {
		t.Error("the exec error is no longer in the chain with Kind set")
	}
	// An error built by a fake, with no run error, unwraps to its kind.
	fake := &Error{Args: []string{"iscsiadm"}, ExitCode: 15, Kind: errdefs.ErrAlreadyExists}
	if !errors.Is(fake, errdefs.ErrAlreadyExists) || fake.Error() != "iscsiadm: exit status 15" {
		t.Errorf("fake error %q", fake)
	}
}
