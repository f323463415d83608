package csitest

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestStepTimes(t *testing.T) {
	var s StepTimes
	var seen int
	log := slog.New(s.Handler(countHandler{&seen}))
	// The agent logs slog.Durations (numbers in JSON); strings are read too.
	for _, ms := range []time.Duration{3, 1, 2} {
		log.Info("staged", slog.Group("took", slog.Duration("attach", ms*time.Millisecond), slog.String("format", "10ms"), slog.Duration("total", 20*time.Millisecond)))
	}
	log.Info("published", slog.Group("took", slog.String("attach", "99s")))
	log.Debug("staged", slog.Group("took", slog.String("attach", "99s")))
	got := s.Summary()
	want := "median of 3 stages: attach 2.0 ms, format 10.0 ms, total 20.0 ms"
	if got != want {
		t.Fatalf("Summary() = %q, want %q", got, want)
	}
	if seen != 4 || !strings.Contains(got, "attach") {
		t.Fatalf("the next handler saw %d records, want 4 (info and above)", seen)
	}
}

type countHandler struct{ n *int }

func (h countHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }
func (h countHandler) Handle(context.Context, slog.Record) error    { *h.n++; return nil }
func (h countHandler) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h countHandler) WithGroup(string) slog.Handler                { return h }
