package systemd

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
)

// notify sends state to $NOTIFY_SOCKET. Without that variable (not run by
// systemd, or Type= is not notify) it does nothing.
func notify(state string) error {
	if _, err := daemon.SdNotify(false, state); err != nil {
		return fmt.Errorf("sd_notify %q: %w", firstLine(state), err)
	}
	return nil
}

func firstLine(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			return s[:i]
		}
	}
	return s
}

// Ready tells systemd that berth serves: call it after the gRPC server
// listens and its first request could be answered, never before. Units
// ordered After=berth.service, and `systemctl start berth` itself, wait
// for this message when the unit has Type=notify.
func Ready() error {
	return notify("READY=1\nSTATUS=serving CSI requests")
}

// Stopping tells systemd that berth began its orderly shutdown, so that
// `systemctl status` shows it and the stop timeout is not mistaken for a
// hang while in-flight operations drain.
func Stopping() error {
	return notify("STOPPING=1\nSTATUS=draining in-flight operations")
}

// LivenessCheck reports whether berth can answer the kubelet right now. It
// should take the path a real request takes (a Probe through the agent's
// own socket, see ProbeEndpoint) so that a wedged accept loop or a
// deadlocked handler makes it fail or hang. It must return when ctx ends.
type LivenessCheck func(ctx context.Context) error

// Watchdog keeps systemd's watchdog (WatchdogSec= in the unit) fed for as
// long as check passes, and returns nil when ctx ends. Each ping is earned:
// check runs once per third of the watchdog interval and WATCHDOG=1 is sent
// only when it succeeded within that third. A check that fails or hangs
// stops the pings, and systemd restarts berth once the interval passes
// (Restart=on-watchdog or on-failure). A hung check is never started twice.
//
// Without WATCHDOG_USEC for this process it returns nil at once.
func Watchdog(ctx context.Context, log *slog.Logger, check LivenessCheck) error {
	interval, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		return fmt.Errorf("watchdog: %w", err)
	}
	if interval == 0 {
		return nil
	}
	runWatchdog(ctx, log, interval, check, notify)
	return nil
}

type checkResult struct {
	err  error
	took time.Duration
}

func runWatchdog(ctx context.Context, log *slog.Logger, interval time.Duration, check LivenessCheck, send func(string) error) {
	period := interval / 3
	if period <= 0 {
		period = interval
	}
	log = log.With("watchdog_interval", interval)
	start := func() <-chan checkResult {
		ch := make(chan checkResult, 1)
		go func() {
			cctx, cancel := context.WithTimeout(ctx, period)
			defer cancel()
			t0 := time.Now()
			err := check(cctx)
			ch <- checkResult{err: err, took: time.Since(t0)}
		}()
		return ch
	}

	healthy := true
	report := func(err error) {
		if err == nil {
			if !healthy {
				log.Info("liveness check passes again, watchdog pings resumed")
				_ = send("STATUS=serving CSI requests")
			}
			healthy = true
			return
		}
		if healthy {
			log.Error("liveness check failed, watchdog pings stopped; systemd restarts berth unless it recovers", "error", err)
			_ = send("STATUS=liveness check failing: " + firstLine(err.Error()))
		}
		healthy = false
	}

	var pending <-chan checkResult
	for {
		if pending == nil {
			pending = start()
		}
		deadline := time.NewTimer(period)
		select {
		case <-ctx.Done():
			deadline.Stop()
			return
		case r := <-pending:
			pending = nil
			switch {
			case r.err != nil:
				report(r.err)
			case r.took > period:
				// A late success is not proof of health: the
				// ping would arrive after the time it vouches for.
				report(fmt.Errorf("liveness check took %s, longer than %s", r.took, period))
			default:
				report(nil)
				if err := send("WATCHDOG=1"); err != nil {
					log.Warn("watchdog ping not delivered", "error", err)
				}
			}
			select {
			case <-ctx.Done():
				deadline.Stop()
				return
			case <-deadline.C:
			}
		case <-deadline.C:
			report(fmt.Errorf("liveness check did not answer within %s", period))
		}
	}
}
