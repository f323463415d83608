package fs

import (
	"log/slog"
	"sync/atomic"
)

var logger atomic.Pointer[slog.Logger]

// SetLogger sets the logger for the package's rare notices (a kernel
// feature fallback). By default slog.Default() is used.
func SetLogger(l *slog.Logger) { logger.Store(l) }

func log() *slog.Logger {
	if l := logger.Load(); l != nil {
		return l
	}
	return slog.Default()
}
