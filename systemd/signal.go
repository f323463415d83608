package systemd

import (
	"context"
	"os/signal"

	"golang.org/x/sys/unix"
)

// StopOnSignal returns a context that ends when berth is asked to stop:
// SIGTERM, the stop signal of systemd (KillSignal=) and of a container
// runtime, or SIGINT from a terminal. stop lets the signals go.
func StopOnSignal(ctx context.Context) (_ context.Context, stop context.CancelFunc) {
	return signal.NotifyContext(ctx, unix.SIGTERM, unix.SIGINT)
}
