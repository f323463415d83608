// Package systemd integrates berth with the service manager that runs it:
// socket activation, readiness and stop notifications, a watchdog that only
// pings while the CSI server really answers, and a log handler that keeps
// slog attributes as journal fields.
//
// Every function is a no-op when berth does not run under systemd (no
// LISTEN_FDS, NOTIFY_SOCKET or WATCHDOG_USEC in the environment), so the
// same binary runs unchanged as a container in a DaemonSet.
package systemd
