package systemd

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/coreos/go-systemd/v22/journal"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type sendLog struct {
	mu   sync.Mutex
	msgs []string
}

func (s *sendLog) send(m string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.msgs = append(s.msgs, m)
	return nil
}

func (s *sendLog) count(m string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, x := range s.msgs {
		if x == m {
			n++
		}
	}
	return n
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, nil))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// waitFor waits until cond holds, checking on every ping interval.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestWatchdogPingsOnlyWhileCheckPasses(t *testing.T) {
	var (
		mode    atomic.Int32 // 0 pass, 1 fail, 2 hang
		running atomic.Int32
		maxRun  atomic.Int32
		release = make(chan struct{})
	)
	check := func(ctx context.Context) error {
		n := running.Add(1)
		defer running.Add(-1)
		for {
			m := maxRun.Load()
			if n <= m || maxRun.CompareAndSwap(m, n) {
				break
			}
		}
		switch mode.Load() {
		case 1:
			return errors.New("probe failed")
		case 2:
			<-release // ignores ctx, like a deadlocked handler
			return nil
		}
		return nil
	}
	var s sendLog
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		runWatchdog(ctx, testLogger(t), 60*time.Millisecond, check, s.send)
		close(done)
	}()
	defer func() { cancel(); <-done }()

	waitFor(t, "3 pings while healthy", func() bool { return s.count("WATCHDOG=1") >= 3 })

	for _, m := range []int32{1, 2} {
		mode.Store(m)
		waitFor(t, "failure status", func() bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			return strings.HasPrefix(s.msgs[len(s.msgs)-1], "STATUS=liveness check failing")
		})
		before := s.count("WATCHDOG=1")
		time.Sleep(300 * time.Millisecond) // 5 watchdog intervals
		if after := s.count("WATCHDOG=1"); after != before {
			t.Fatalf("mode %d: %d pings sent while the check did not pass", m, after-before)
		}
		if m == 2 {
			close(release)
		}
		mode.Store(0)
		waitFor(t, "pings to resume", func() bool { return s.count("WATCHDOG=1") > before })
	}
	if n := maxRun.Load(); n != 1 {
		t.Errorf("%d checks ran at once, want 1 (a hung check must not be started again)", n)
	}
}

func TestListenerWithoutActivation(t *testing.T) {
	t.Setenv("LISTEN_PID", "")
	t.Setenv("LISTEN_FDS", "")
	l, err := Listener("/run/berth/csi.sock")
	if err != nil || l != nil {
		t.Fatalf("Listener() = %v, %v; want nil, nil without LISTEN_FDS", l, err)
	}
}

func TestJournalHandlerFields(t *testing.T) {
	type entry struct {
		msg  string
		pri  journal.Priority
		vars map[string]string
	}
	var got []entry
	send := func(m string, p journal.Priority, v map[string]string) error {
		got = append(got, entry{m, p, v})
		return nil
	}
	log := slog.New(newJournalHandler(nil, send, slog.NewJSONHandler(tWriter{t}, nil)))
	log.With("volume_id", "pvc-1").WithGroup("req").Warn("stage failed",
		"target-path", "/var/lib/kubelet/x", "_trusted", "no", "message", "spoof", "took", 1500*time.Millisecond,
		slog.Group("dev", "major", 8, "minor", 16))
	log.Debug("not shown")

	if len(got) != 1 {
		t.Fatalf("got %d journal entries, want 1", len(got))
	}
	e := got[0]
	if e.msg != "stage failed" || e.pri != journal.PriWarning {
		t.Errorf("message %q priority %d, want %q %d", e.msg, e.pri, "stage failed", journal.PriWarning)
	}
	want := map[string]string{
		"VOLUME_ID":         "pvc-1",
		"REQ_TARGET_PATH":   "/var/lib/kubelet/x",
		"REQ_TRUSTED":       "no",
		"REQ_MESSAGE":       "spoof",
		"REQ_TOOK":          "1.5",
		"REQ_DEV_MAJOR":     "8",
		"REQ_DEV_MINOR":     "16",
		"SYSLOG_IDENTIFIER": "berth",
	}
	for k, v := range want {
		if e.vars[k] != v {
			t.Errorf("field %s = %q, want %q (all: %v)", k, e.vars[k], v, e.vars)
		}
	}
	for k := range e.vars {
		if k == "MESSAGE" || k == "PRIORITY" || strings.HasPrefix(k, "_") {
			t.Errorf("attribute became reserved field %s", k)
		}
	}

	got = nil
	slog.New(newJournalHandler(nil, send, nil)).Info("x", "message", "spoof", "_PID", "1")
	if v := got[0].vars; v["BERTH_MESSAGE"] != "spoof" || v["PID"] != "1" {
		t.Errorf("reserved names not renamed: %v", v)
	}
}

func TestFieldName(t *testing.T) {
	for in, want := range map[string]string{
		"volume_id": "VOLUME_ID", "targetPath": "TARGETPATH", "a.b-c": "A_B_C",
		"__x": "X", "9lives": "F9LIVES", "ünï": "N_",
	} {
		if got := fieldName(in); got != want {
			t.Errorf("fieldName(%q) = %q, want %q", in, got, want)
		}
	}
}

type probeServer struct {
	csi.UnimplementedIdentityServer
	err   error
	block chan struct{}
}

func (s *probeServer) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if s.block != nil {
		select {
		case <-s.block:
		case <-ctx.Done():
		}
	}
	return &csi.ProbeResponse{}, s.err
}

func TestProbeEndpoint(t *testing.T) {
	for _, tc := range []struct {
		name  string
		srv   *probeServer
		alive bool
	}{
		{"answers", &probeServer{}, true},
		{"node not ready", &probeServer{err: status.Error(codes.FailedPrecondition, "iscsid is not reachable")}, true},
		{"wedged", &probeServer{block: make(chan struct{})}, false},
		{"no server", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "csi.sock")
			if tc.srv != nil {
				l, err := net.Listen("unix", sock)
				if err != nil {
					t.Fatal(err)
				}
				srv := grpc.NewServer()
				csi.RegisterIdentityServer(srv, tc.srv)
				go srv.Serve(l)
				defer srv.Stop()
				if tc.srv.block != nil {
					defer close(tc.srv.block)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			err := ProbeEndpoint(sock)(ctx)
			if (err == nil) != tc.alive {
				t.Fatalf("ProbeEndpoint = %v, want alive=%v", err, tc.alive)
			}
		})
	}
}

// Every duration in berth's JSON logs is a number of seconds, at the top
// level and inside groups, whichever way the attribute was made.
func TestJSONLogDurationsAreSeconds(t *testing.T) {
	var buf strings.Builder
	log := slog.New(NewLogHandler(&buf, nil))
	log.With("timeout", 30*time.Second).Info("done", slog.Duration("duration", 1500*time.Millisecond),
		slog.Group("took", slog.Duration("mount", 2*time.Millisecond), "total", 250*time.Microsecond))
	var line map[string]any
	if err := json.Unmarshal([]byte(buf.String()), &line); err != nil {
		t.Fatalf("log line %q: %v", buf.String(), err)
	}
	took, _ := line["took"].(map[string]any)
	for _, c := range []struct {
		key  string
		got  any
		want float64
	}{{"timeout", line["timeout"], 30}, {"duration", line["duration"], 1.5}, {"took.mount", took["mount"], 0.002}, {"took.total", took["total"], 0.00025}} {
		if f, ok := c.got.(float64); !ok || f != c.want {
			t.Errorf("%s = %#v, want %v (seconds) in %s", c.key, c.got, c.want, buf.String())
		}
	}
	if !strings.Contains(buf.String(), `"duration":1.5`) {
		t.Errorf("duration not written as seconds: %s", buf.String())
	}
}
