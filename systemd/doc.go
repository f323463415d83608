// Package systemd integrates berth with the service manager that runs it:
// socket activation, readiness and stop notifications, the signals that
// ask it to stop, a watchdog that only pings while the CSI server really
// answers, and a log handler that keeps slog attributes as journal fields.
//
// What needs systemd is a no-op when berth does not run under it (no
// LISTEN_FDS, NOTIFY_SOCKET or WATCHDOG_USEC in the environment), so the
// same binary runs unchanged as a container in a DaemonSet, where the
// container runtime sends the same stop signal.
package systemd
