package fs

import "log/slog"

// log is the logger for the package's rare notices (a kernel feature
// fallback, logged once per process): the process's default logger,
// which berth sets to its own at start.
func log() *slog.Logger { return slog.Default() }
