package csitest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
)

// StepTimes collects the step times the agent logs with each finished
// NodeStageVolume (the "took" group of its "staged" line), for
// benchmarks to report where the time went.
type StepTimes struct {
	mu    sync.Mutex
	steps map[string][]time.Duration
	order []string
}

// Handler returns a slog handler for the agent's logger that feeds s;
// records are also passed to next when it is not nil.
func (s *StepTimes) Handler(next slog.Handler) slog.Handler {
	h := slog.Handler(slog.NewJSONHandler(stepWriter{s}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if next != nil {
		h = teeHandler{h, next}
	}
	return h
}

type stepWriter struct{ s *StepTimes }

func (w stepWriter) Write(b []byte) (int, error) {
	// Most lines are not a stage's end; they are not decoded (this
	// runs inside the benchmarks' measured time).
	if !bytes.Contains(b, []byte(`"msg":"staged`)) {
		return len(b), nil
	}
	var line struct {
		Msg  string                     `json:"msg"`
		Took map[string]json.RawMessage `json:"took"`
	}
	if err := json.Unmarshal(b, &line); err != nil || !strings.HasPrefix(line.Msg, "staged") {
		return len(b), nil
	}
	s := w.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.steps == nil {
		s.steps = make(map[string][]time.Duration)
	}
	// The JSON object keeps the agent's step order; map iteration
	// does not, so the order is taken from the raw line.
	for _, k := range orderedKeys(b) {
		d, err := stepDuration(line.Took[k])
		if err != nil {
			continue
		}
		if _, ok := s.steps[k]; !ok {
			s.order = append(s.order, k)
		}
		s.steps[k] = append(s.steps[k], d)
	}
	return len(b), nil
}

// stepDuration reads a step time as slog's JSON handler writes a
// time.Duration (nanoseconds), or as a duration string.
func stepDuration(v json.RawMessage) (time.Duration, error) {
	var ns int64
	if err := json.Unmarshal(v, &ns); err == nil {
		return time.Duration(ns), nil
	}
	var s string
	if err := json.Unmarshal(v, &s); err != nil {
		return 0, err
	}
	return time.ParseDuration(s)
}

// orderedKeys returns the keys of the "took" object in b in their order.
func orderedKeys(b []byte) []string {
	i := strings.Index(string(b), `"took":{`)
	if i < 0 {
		return nil
	}
	dec := json.NewDecoder(strings.NewReader(string(b[i+len(`"took":`):])))
	if _, err := dec.Token(); err != nil {
		return nil
	}
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return keys
		}
		k, _ := tok.(string)
		keys = append(keys, k)
		if _, err := dec.Token(); err != nil {
			return keys
		}
	}
	return keys
}

// MoveTo moves the stages s collected so far to to, leaving s empty:
// a benchmark that stages two ways with one agent sorts each stage's
// steps by its way.
func (s *StepTimes) MoveTo(to *StepTimes) {
	s.mu.Lock()
	steps, order := s.steps, s.order
	s.steps, s.order = nil, nil
	s.mu.Unlock()
	to.mu.Lock()
	defer to.mu.Unlock()
	if to.steps == nil {
		to.steps = make(map[string][]time.Duration)
	}
	for _, k := range order {
		if _, ok := to.steps[k]; !ok {
			to.order = append(to.order, k)
		}
		to.steps[k] = append(to.steps[k], steps[k]...)
	}
}

// Summary is one line: the median of each step over the collected
// stages, in the agent's order.
func (s *StepTimes) Summary() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var parts []string
	for _, k := range s.order {
		d := slices.Clone(s.steps[k])
		slices.Sort(d)
		parts = append(parts, fmt.Sprintf("%s %.1f ms", k, float64(d[len(d)/2])/float64(time.Millisecond)))
	}
	n := len(s.steps["total"])
	return fmt.Sprintf("median of %d stages: %s", n, strings.Join(parts, ", "))
}

// teeHandler passes records to two handlers.
type teeHandler struct{ a, b slog.Handler }

func (h teeHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.a.Enabled(ctx, l) || h.b.Enabled(ctx, l)
}

func (h teeHandler) Handle(ctx context.Context, r slog.Record) error {
	var errs []error
	if h.a.Enabled(ctx, r.Level) {
		errs = append(errs, h.a.Handle(ctx, r.Clone()))
	}
	if h.b.Enabled(ctx, r.Level) {
		errs = append(errs, h.b.Handle(ctx, r))
	}
	return errors.Join(errs...)
}

func (h teeHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return teeHandler{h.a.WithAttrs(as), h.b.WithAttrs(as)}
}

func (h teeHandler) WithGroup(name string) slog.Handler {
	return teeHandler{h.a.WithGroup(name), h.b.WithGroup(name)}
}

var _ io.Writer = stepWriter{}
