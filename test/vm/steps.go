package vm

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// Steps: a guest that runs whichever step the host names (ServeSteps),
// the host naming them one at a time (Machine.Step), and the groups of
// steps a run goes through (Groups). A guest's signals are a set: each
// answer names the step and how many times the guest ran it, so that a
// repeated step waits for its own answer.

// Step sends name to a guest that serves steps and waits until the guest
// has run it, at most timeout. Host side.
func (m *Machine) Step(name string, timeout time.Duration) {
	m.t.Helper()
	m.mu.Lock()
	if m.stepRounds == nil {
		m.stepRounds = map[string]int{}
	}
	m.stepRounds[name]++
	round := m.stepRounds[name]
	m.mu.Unlock()
	m.Send(name)
	m.WaitSignal(stepDone(name, round), timeout)
}

// ServeSteps runs the steps the host names with Machine.Step, in the
// host's order, until it sends "stop". A name the guest has no step for
// fails the test. Guest side.
func ServeSteps(t testing.TB, steps map[string]func()) {
	t.Helper()
	rounds := map[string]int{}
	for {
		name := NextHost(t)
		if name == "stop" {
			return
		}
		fn, ok := steps[name]
		if !ok {
			t.Fatalf("the host asked for step %q, which this guest does not have", name)
		}
		fn()
		rounds[name]++
		SignalHost(stepDone(name, rounds[name]))
	}
}

func stepDone(name string, round int) string { return fmt.Sprintf("%s-done-%d", name, round) }

// Groups is the set of groups a run goes through: those the environment
// variable env names (comma-separated; a name not in all fails the test),
// every one of all when it is empty. The caller runs them in its own
// order, whatever the order in env. Host side.
func Groups(t testing.TB, env string, all []string) map[string]bool {
	t.Helper()
	return groups(t, env, os.Getenv(env), all)
}

func groups(t testing.TB, env, names string, all []string) map[string]bool {
	t.Helper()
	m := map[string]bool{}
	if names == "" {
		for _, g := range all {
			m[g] = true
		}
		return m
	}
	for _, g := range strings.Split(names, ",") {
		if !slices.Contains(all, g) {
			t.Fatalf("%s: no group %q; the groups are %s", env, g, strings.Join(all, ","))
		}
		m[g] = true
	}
	return m
}
