package vm

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
)

// testEvent is one event of `go test -json` (cmd/test2json).
type testEvent struct {
	Action  string
	Test    string
	Output  string
	Elapsed float64
}

// test2json decodes the guest's -test.v=test2json output with `go tool test2json`.
type test2json struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	mu     sync.Mutex
	events []testEvent
	done   chan error
}

func newTest2JSON(name string) (*test2json, error) {
	cmd := exec.Command(goTool(), "tool", "test2json", "-p", name)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("go tool test2json: %w", err)
	}
	j := &test2json{cmd: cmd, stdin: stdin, done: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			var ev testEvent
			if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
				continue
			}
			j.mu.Lock()
			j.events = append(j.events, ev)
			j.mu.Unlock()
		}
		j.done <- sc.Err()
	}()
	return j, nil
}

func (j *test2json) write(s string) { io.WriteString(j.stdin, s) }

func (j *test2json) finish() ([]testEvent, error) {
	j.stdin.Close()
	err := <-j.done
	werr := j.cmd.Wait()
	if err == nil && werr != nil {
		// test2json exits 1 when the tests failed; that is not an error here.
		if _, ok := werr.(*exec.ExitError); !ok {
			err = werr
		}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.events, err
}

type testResult struct {
	name    string
	action  string // pass, fail, skip, or "" when it never finished
	elapsed float64
	output  []string
}

// collectResults groups events by top-level test, in the order they started.
// Subtests' output stays with their top-level test.
func collectResults(events []testEvent) []*testResult {
	var order []*testResult
	byName := map[string]*testResult{}
	for _, ev := range events {
		if ev.Test == "" {
			continue
		}
		top, _, sub := strings.Cut(ev.Test, "/")
		r := byName[top]
		if r == nil {
			r = &testResult{name: top}
			byName[top] = r
			order = append(order, r)
		}
		switch ev.Action {
		case "output":
			o := ev.Output
			if !sub && (strings.HasPrefix(o, "=== RUN") || strings.HasPrefix(o, "=== PAUSE") || strings.HasPrefix(o, "=== CONT")) {
				continue
			}
			if strings.HasPrefix(o, signalMarker) {
				continue
			}
			r.output = append(r.output, o)
		case "pass", "fail", "skip":
			if !sub {
				r.action, r.elapsed = ev.Action, ev.Elapsed
			}
		}
	}
	return order
}
