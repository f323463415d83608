package vm

import (
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
)

// WaitSignal waits until the guest called SignalHost(name). It fails the
// test when the guest stops first or timeout passes.
func (m *Machine) WaitSignal(name string, timeout time.Duration) {
	m.t.Helper()
	deadline := time.AfterFunc(timeout, func() {
		m.mu.Lock()
		m.cond.Broadcast()
		m.mu.Unlock()
	})
	defer deadline.Stop()
	end := time.Now().Add(timeout)
	m.mu.Lock()
	defer m.mu.Unlock()
	for !m.signals[name] {
		if m.exited {
			m.t.Fatalf("vm %s: stopped before signalling %q\n%s", m.name, name, m.diagnosticsLocked())
		}
		if time.Now().After(end) {
			m.t.Fatalf("vm %s: no signal %q within %v\n%s", m.name, name, timeout, m.diagnosticsLocked())
		}
		m.cond.Wait()
	}
}

// Send writes a line to the guest, read there by WaitHost.
func (m *Machine) Send(name string) {
	m.t.Helper()
	m.mu.Lock()
	c := m.conn
	m.mu.Unlock()
	if c == nil {
		m.t.Fatalf("vm %s: guest is not connected", m.name)
	}
	if _, err := io.WriteString(c, name+"\n"); err != nil {
		m.t.Fatalf("vm %s: send %q: %v", m.name, name, err)
	}
}

func (m *Machine) diagnosticsLocked() string {
	var b strings.Builder
	fmt.Fprintf(&b, "--- console tail ---\n%s\n", strings.Join(m.console, "\n"))
	fmt.Fprintf(&b, "--- guest test output tail ---\n%s\n", tail(m.guestOut.String(), 40))
	b.WriteString(m.reproduce())
	return b.String()
}

// ReportTests maps each in-guest top-level test to a subtest of t with its
// result and output, and fails t when the guest crashed, hung, ran no test
// or its test binary failed outside any test. It waits for the guest.
func (m *Machine) ReportTests(t *testing.T) {
	t.Helper()
	m.Wait()
	m.mu.Lock()
	events := m.events
	exitCode, panicked, timedOut, killed := m.exitCode, m.panicked, m.timedOut, m.killed
	coverErr := m.coverErr
	diag := m.diagnosticsLocked()
	booted := m.booted
	m.mu.Unlock()

	results := collectResults(events)
	anyFailed := false
	for _, r := range results {
		r := r
		if r.action == "fail" || r.action == "" {
			anyFailed = true
		}
		t.Run(r.name, func(t *testing.T) {
			for _, l := range r.output {
				t.Log(strings.TrimRight(l, "\n"))
			}
			switch r.action {
			case "fail":
				t.Errorf("in-guest test %s failed (%.2fs)", r.name, r.elapsed)
			case "skip":
				t.SkipNow()
			case "pass":
			default:
				t.Errorf("in-guest test %s did not finish", r.name)
			}
		})
	}
	t.Logf("vm %s: boot %v, total %v, %d in-guest tests", m.name, booted.Round(time.Millisecond),
		time.Since(m.started).Round(time.Millisecond), len(results))
	if coverErr != nil {
		t.Error(coverErr)
	}
	switch {
	case timedOut:
		t.Errorf("vm %s: guest did not finish within %v\n%s", m.name, m.cfg.timeout, diag)
	case panicked:
		t.Errorf("vm %s: kernel panic\n%s", m.name, diag)
	case exitCode < 0 && !killed:
		t.Errorf("vm %s: guest stopped without reporting its exit status\n%s", m.name, diag)
	case exitCode < 0:
	case len(results) == 0 && booted == 0:
		t.Errorf("vm %s: guest init failed (status %d) before running the tests\n%s", m.name, exitCode, diag)
	case len(results) == 0:
		t.Errorf("vm %s: no in-guest test ran (check WithTestRun and that the tests exist)\n%s", m.name, diag)
	case exitCode != 0 && !anyFailed:
		t.Errorf("vm %s: in-guest test binary exited %d\n%s", m.name, exitCode, diag)
	case anyFailed:
		t.Log(m.reproduce())
	}
}

// RunGuestTests runs this package's in-guest tests in a new guest and reports
// each of them as a subtest of t. A guest whose kernel oopses in one of
// knownKernelBugs is run once more, from a fresh boot. It returns the
// guest, which has ended, for what else its output holds.
func RunGuestTests(t *testing.T, opts ...Option) *Machine {
	t.Helper()
	m := Boot(t, append(opts, func(c *config) { c.rerunOnKernelBug = true })...)
	m.ReportTests(t)
	return m
}
