package systemd

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/journal"
)

// NewLogHandler returns the handler berth logs through.
//
// Under systemd, with stderr connected to the journal (JOURNAL_STREAM names
// stderr's device and inode, see systemd.exec(5)), records go to journald
// through its native protocol: the message becomes MESSAGE, the level
// becomes PRIORITY, and every attribute becomes a field of its own
// (volume_id -> VOLUME_ID), so `journalctl -u berth VOLUME_ID=pvc-1` and
// `journalctl -p warning` work. JSON written to stderr would be kept by
// journald as one opaque MESSAGE string with the priority of the stream.
//
// Anywhere else (a container, a terminal) it writes one JSON object per line
// to w, which log collectors parse without configuration.
//
// Durations are written as seconds (a float: 0.0025), in JSON and in the
// journal alike, so that one query works on every duration attribute.
func NewLogHandler(w io.Writer, opts *slog.HandlerOptions) slog.Handler {
	o := slog.HandlerOptions{}
	if opts != nil {
		o = *opts
	}
	if next := o.ReplaceAttr; next != nil {
		o.ReplaceAttr = func(groups []string, a slog.Attr) slog.Attr { return next(groups, DurationSeconds(groups, a)) }
	} else {
		o.ReplaceAttr = DurationSeconds
	}
	fallback := slog.NewJSONHandler(w, &o)
	if ok, err := journal.StderrIsJournalStream(); err != nil || !ok || !journal.Enabled() {
		return fallback
	}
	return newJournalHandler(opts, journal.Send, fallback)
}

// DurationSeconds is a slog.HandlerOptions.ReplaceAttr that writes a
// time.Duration attribute as seconds, a float64: the one format of
// durations in berth's logs (slog's JSON handler would write integer
// nanoseconds, its text handler "1.5s").
func DurationSeconds(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.Float64Value(a.Value.Duration().Seconds())
	}
	return a
}

type sendFunc func(message string, priority journal.Priority, vars map[string]string) error

// journalHandler is a slog.Handler for journald's native protocol. Records
// it cannot deliver (journald restarting) go to the fallback handler.
type journalHandler struct {
	level    slog.Leveler
	send     sendFunc
	fallback slog.Handler
	prefix   string            // open groups, as FIELD_ name prefix
	fields   map[string]string // attributes from WithAttrs
}

func newJournalHandler(opts *slog.HandlerOptions, send sendFunc, fallback slog.Handler) *journalHandler {
	h := &journalHandler{level: slog.LevelInfo, send: send, fallback: fallback}
	if opts != nil && opts.Level != nil {
		h.level = opts.Level
	}
	return h
}

func (h *journalHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= h.level.Level()
}

func (h *journalHandler) Handle(ctx context.Context, r slog.Record) error {
	vars := make(map[string]string, len(h.fields)+r.NumAttrs()+2)
	for k, v := range h.fields {
		vars[k] = v
	}
	r.Attrs(func(a slog.Attr) bool {
		addField(vars, h.prefix, a)
		return true
	})
	vars["SYSLOG_IDENTIFIER"] = "berth"
	if !r.Time.IsZero() {
		vars["BERTH_TIME"] = r.Time.UTC().Format(time.RFC3339Nano)
	}
	if err := h.send(r.Message, priority(r.Level), vars); err != nil {
		return h.fallback.Handle(ctx, r)
	}
	return nil
}

func (h *journalHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := *h
	c.fields = make(map[string]string, len(h.fields)+len(attrs))
	for k, v := range h.fields {
		c.fields[k] = v
	}
	for _, a := range attrs {
		addField(c.fields, h.prefix, a)
	}
	c.fallback = h.fallback.WithAttrs(attrs)
	return &c
}

func (h *journalHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	c := *h
	c.prefix = h.prefix + fieldName(name) + "_"
	c.fallback = h.fallback.WithGroup(name)
	return &c
}

func addField(vars map[string]string, prefix string, a slog.Attr) {
	v := a.Value.Resolve()
	if v.Kind() == slog.KindGroup {
		p := prefix
		if a.Key != "" {
			p += fieldName(a.Key) + "_"
		}
		for _, ga := range v.Group() {
			addField(vars, p, ga)
		}
		return
	}
	if a.Key == "" {
		return
	}
	name := prefix + fieldName(a.Key)
	if name == "" || reserved[name] {
		name = "BERTH_" + name
	}
	switch v.Kind() {
	case slog.KindTime:
		vars[name] = v.Time().UTC().Format(time.RFC3339Nano)
	case slog.KindDuration:
		vars[name] = strconv.FormatFloat(v.Duration().Seconds(), 'f', -1, 64)
	case slog.KindString:
		vars[name] = v.String()
	case slog.KindInt64:
		vars[name] = strconv.FormatInt(v.Int64(), 10)
	default:
		vars[name] = v.String()
	}
}

// reserved are the fields the record itself sets; an attribute with such a
// name would replace the message or priority.
var reserved = map[string]bool{"MESSAGE": true, "PRIORITY": true, "SYSLOG_IDENTIFIER": true, "MESSAGE_ID": true}

// fieldName maps an attribute key to a journal field name: upper-case ASCII
// letters, digits and underscores, not starting with an underscore (those
// are trusted fields journald sets itself) or a digit.
func fieldName(key string) string {
	var b strings.Builder
	for _, c := range key {
		switch {
		case c >= 'a' && c <= 'z':
			b.WriteRune(c - 'a' + 'A')
		case c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
			b.WriteRune(c)
		default:
			b.WriteByte('_')
		}
	}
	s := strings.TrimLeft(b.String(), "_")
	if s != "" && s[0] >= '0' && s[0] <= '9' {
		s = "F" + s
	}
	return s
}

func priority(l slog.Level) journal.Priority {
	switch {
	case l >= slog.LevelError:
		return journal.PriErr
	case l >= slog.LevelWarn:
		return journal.PriWarning
	case l >= slog.LevelInfo:
		return journal.PriInfo
	default:
		return journal.PriDebug
	}
}
