package agent

import (
	"context"
	"log/slog"
	"sync"

	"google.golang.org/grpc"
)

// leftRunning counts the steps that went on in the background after
// their call ended (see blocking): an unmount still writing back, a
// flush, a detach. Serve waits for them before it returns, because the
// process's exit would cut them: a step that runs a program (iscsiadm,
// e2fsck) loses it when the rest of the unit's cgroup or the pod's
// container is killed with berth, and a step of several kernel calls
// (one NVMe controller deleted, the next not yet) stops between two. The
// zero value is ready.
type leftRunning struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n falls back to 0
}

func (l *leftRunning) add() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.n == 0 {
		l.idle = make(chan struct{})
	}
	l.n++
}

func (l *leftRunning) done() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n--
	if l.n == 0 {
		close(l.idle)
	}
}

// wait waits until no step is left running or ctx ends, and returns the
// number of steps still running.
func (l *leftRunning) wait(ctx context.Context) int {
	for {
		l.mu.Lock()
		n, idle := l.n, l.idle
		l.mu.Unlock()
		if n == 0 {
			return 0
		}
		select {
		case <-idle:
		case <-ctx.Done():
			l.mu.Lock()
			defer l.mu.Unlock()
			return l.n
		}
	}
}

// stopGRPC stops s gracefully: no new call is accepted and those in
// flight finish (their contexts are not cancelled). Calls still running
// when ctx ends are cut.
func stopGRPC(ctx context.Context, log *slog.Logger, s *grpc.Server) {
	done := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		log.Warn("calls still in flight after the shutdown timeout; cutting them")
		s.Stop()
		<-done
	}
}

// finish waits, until ctx ends, for a trim under way and for the steps
// that calls left running; what still runs then is left to the kernel,
// and the volume's record lets the next berth finish the work, as after
// a crash.
func (a *Agent) finish(ctx context.Context, trimDone <-chan struct{}) {
	select {
	case <-trimDone:
	case <-ctx.Done():
		a.log.Warn("a trim is still running after the shutdown timeout; exiting without waiting for it")
	}
	a.left.mu.Lock()
	n := a.left.n
	a.left.mu.Unlock()
	if n == 0 {
		return
	}
	a.log.Info("stopping: waiting for steps that calls left running", slog.Int("steps", n))
	if n := a.left.wait(ctx); n > 0 {
		a.log.Warn("steps that calls left running are still in the kernel after the shutdown timeout; exiting without them (the next berth finishes their volumes' calls from the records)", slog.Int("steps", n))
	}
}
