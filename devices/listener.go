package devices

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
)

// ErrListenerClosed is returned by Wait after the listener was closed.
var ErrListenerClosed = errors.New("uevent listener closed")

// ListenerOption configures NewListener.
type ListenerOption func(*listenerConfig)

type listenerConfig struct {
	udev   int // 0 detect, 1 on, -1 off
	hook   func(EventInfo)
	log    *slog.Logger
	rcvbuf int
	roots  Roots
	// nodeMatches reports whether a found device's node exists with its
	// number; nil checks the node (tests on fake trees have no nodes).
	nodeMatches func(*Device) bool
	// beforeConfigure is called with the name of the free loop device an
	// attach is about to configure (tests).
	beforeConfigure func(name string)
	// noLoopConfigure binds loop devices with LOOP_SET_FD and
	// LOOP_SET_STATUS64 even where LOOP_CONFIGURE exists (tests).
	noLoopConfigure bool
}

// WithLogger sets the logger for events the listener cannot return as an
// error (a dropped message, a receive queue overflow).
func WithLogger(l *slog.Logger) ListenerOption {
	return func(c *listenerConfig) { c.log = l }
}

// Listener receives uevents on one netlink socket and fans them out to the
// Waiters subscribed to it. One Listener serves the whole agent.
type Listener struct {
	roots           Roots
	nodeMatches     func(*Device) bool
	beforeConfigure func(name string)
	noLoopConfigure bool
	udev            bool
	hook            func(EventInfo)
	log             *slog.Logger
	conn            *ueventConn // nil in tests that feed events by hand

	mu       sync.Mutex
	subs     map[*Waiter]struct{}
	watchers map[*func(EventInfo)]struct{}
	state    map[string]*devState // by kernel name, block devices only
	err      error                // why the receive loop stopped

	overflows atomic.Uint64

	done      chan struct{} // closed when the receive loop has stopped
	closeOnce sync.Once

	// Barrier through the socket's own receive queue, see sync.
	syncMu   sync.Mutex
	syncSent uint64
	syncSeen uint64
	progress chan struct{} // closed and replaced when syncSeen moves or the queue drains
}

// devState remembers the last kernel and udev event of a block device, so
// that a sysfs scan knows whether udev still has an event of it in hand.
type devState struct {
	kernel, udev EventInfo
}

func newListener(cfg listenerConfig, udev bool) *Listener {
	l := &Listener{
		roots:           cfg.roots,
		nodeMatches:     cfg.nodeMatches,
		beforeConfigure: cfg.beforeConfigure,
		noLoopConfigure: cfg.noLoopConfigure,
		udev:            udev,
		hook:            cfg.hook,
		log:             cfg.log,
		subs:            make(map[*Waiter]struct{}),
		watchers:        make(map[*func(EventInfo)]struct{}),
		state:           make(map[string]*devState),
		done:            make(chan struct{}),
		progress:        make(chan struct{}),
	}
	if l.log == nil {
		l.log = slog.Default()
	}
	if l.nodeMatches == nil {
		l.nodeMatches = nodeMatches
	}
	return l
}

// Overflows returns how often the kernel dropped uevents because the
// receive queue was full (each time, all waiters rescanned sysfs).
func (l *Listener) Overflows() uint64 { return l.overflows.Load() }

// Roots returns the trees the listener reads devices from (the host's for
// a nil listener).
func (l *Listener) Roots() Roots {
	if l == nil {
		return Roots{}
	}
	return l.roots
}

// Udev reports whether the listener waits for udev to process devices.
func (l *Listener) Udev() bool { return l.udev }

// Subscribe registers interest in the device m matches. Call it before the
// action that creates the device, then call Wait; Close the Waiter when done.
func (l *Listener) Subscribe(m Matcher) *Waiter {
	w := l.newWaiter()
	w.m = m
	if km, ok := m.(kindMatcher); ok {
		w.kind = km.kind()
	}
	return w
}

// subscribeRemoval returns a Waiter whose Wait returns (nil, nil) once dev
// no longer exists under its name and number.
func (l *Listener) subscribeRemoval(dev *Device) *Waiter {
	return l.subscribeUntil(dev.Name, "removal of "+dev.String(), func() bool { return isGone(dev) })
}

// subscribeUntil returns a Waiter whose Wait returns (nil, nil) once cond
// holds; cond is checked at the start of Wait and after every event of the
// block device name.
func (l *Listener) subscribeUntil(name, what string, cond func() bool) *Waiter {
	w := l.newWaiter()
	w.untilName, w.untilWhat, w.until = name, what, cond
	return w
}

func (l *Listener) newWaiter() *Waiter {
	w := &Waiter{l: l, wake: make(chan struct{}, 1), subscribed: time.Now()}
	l.mu.Lock()
	l.subs[w] = struct{}{}
	l.mu.Unlock()
	return w
}

// dispatch hands one received event to every waiter.
func (l *Listener) dispatch(ev *Event) {
	if l.hook != nil {
		l.hook(ev.info())
	}
	if ev.Subsystem != "block" {
		return
	}
	e := &event{Event: ev, roots: l.roots}
	l.mu.Lock()
	l.record(ev)
	subs := make([]*Waiter, 0, len(l.subs))
	for w := range l.subs {
		subs = append(subs, w)
	}
	watchers := make([]func(EventInfo), 0, len(l.watchers))
	for fn := range l.watchers {
		watchers = append(watchers, *fn)
	}
	l.mu.Unlock()
	for _, w := range subs {
		w.push(e)
	}
	for _, fn := range watchers {
		fn(ev.info())
	}
}

// Notify calls fn with every block uevent received from now on (the
// kernel's, and udev's when the listener waits for udev) until the
// returned function is called. fn runs on the receive loop: it must
// not block. After an overflow of the receive queue events were lost,
// which fn is not told: a caller that must not miss one also looks at
// sysfs now and then.
func (l *Listener) Notify(fn func(EventInfo)) (stop func()) {
	p := &fn
	l.mu.Lock()
	l.watchers[p] = struct{}{}
	l.mu.Unlock()
	return func() {
		l.mu.Lock()
		delete(l.watchers, p)
		l.mu.Unlock()
	}
}

// record updates the per-device event state; l.mu is held.
func (l *Listener) record(ev *Event) {
	name := ev.Name()
	st := l.state[name]
	if st == nil {
		if ev.Action == "remove" {
			return
		}
		st = &devState{}
		l.state[name] = st
	}
	switch ev.Source {
	case SourceKernel:
		st.kernel = ev.info()
		if ev.Action == "remove" && !l.udev {
			delete(l.state, name)
		}
	case SourceUdev:
		st.udev = ev.info()
		if ev.Action == "remove" && st.kernel.Seqnum <= ev.Seqnum {
			delete(l.state, name)
		}
	}
}

// udevPending reports whether the kernel sent an event for name that udev
// has not finished yet.
func (l *Listener) udevPending(name string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	st := l.state[name]
	return st != nil && st.kernel.Seqnum > st.udev.Seqnum
}

func (l *Listener) lastEvents(name string) devState {
	l.mu.Lock()
	defer l.mu.Unlock()
	if st := l.state[name]; st != nil {
		return *st
	}
	return devState{}
}

// overflow is called when the kernel dropped messages because the receive
// queue was full: every waiter scans sysfs again, and what the listener knew
// about udev's progress is forgotten, since some of it was lost.
func (l *Listener) overflow() {
	l.overflows.Add(1)
	l.mu.Lock()
	clear(l.state)
	subs := make([]*Waiter, 0, len(l.subs))
	for w := range l.subs {
		subs = append(subs, w)
	}
	l.mu.Unlock()
	l.log.Warn("uevent receive queue overflowed; rescanning sysfs for all waiters", "waiters", len(subs))
	for _, w := range subs {
		w.setRescan()
	}
}

// stop ends the listener with err; every Wait returns.
func (l *Listener) stop(err error) {
	l.mu.Lock()
	if l.err == nil {
		l.err = err
	}
	l.mu.Unlock()
}

// markSynced records that the barrier with the given id came through the
// receive queue, or (id 0) that the queue was found empty.
func (l *Listener) markSynced(id uint64) {
	l.syncMu.Lock()
	if id > l.syncSeen {
		l.syncSeen = id
	}
	close(l.progress)
	l.progress = make(chan struct{})
	l.syncMu.Unlock()
}

// sync returns once every message that was in the socket's receive queue
// when it was called has been dispatched. It sends a marker to the socket's
// own address: netlink queues it behind the messages already waiting, so when
// the receive loop reads it, they have all been handled. A scan that follows
// therefore sees the kernel events of the action the caller just performed.
func (l *Listener) sync(ctx context.Context) error {
	if l.conn == nil {
		return nil
	}
	l.syncMu.Lock()
	l.syncSent++
	id := l.syncSent
	l.syncMu.Unlock()
	const maxSendAttempts = 64
	for attempt := 1; ; attempt++ {
		l.syncMu.Lock()
		progress := l.progress
		l.syncMu.Unlock()
		err := l.conn.sendMarker(id)
		if err == nil {
			break
		}
		if !isQueueFull(err) || attempt == maxSendAttempts {
			return fmt.Errorf("uevent listener: queue barrier: %w", err)
		}
		// The queue is full; wait until the receive loop has drained some.
		select {
		case <-progress:
		case <-ctx.Done():
			return ctx.Err()
		case <-l.done:
			return l.closedErr()
		}
	}
	for {
		l.syncMu.Lock()
		seen, progress := l.syncSeen, l.progress
		l.syncMu.Unlock()
		if seen >= id {
			return nil
		}
		select {
		case <-progress:
		case <-ctx.Done():
			return ctx.Err()
		case <-l.done:
			return l.closedErr()
		}
	}
}

func (l *Listener) closedErr() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil && !errors.Is(l.err, ErrListenerClosed) {
		return fmt.Errorf("%w: %w", ErrListenerClosed, l.err)
	}
	return ErrListenerClosed
}

// event is a received block event shared by all waiters; the device it
// names is read from sysfs once, by the first waiter that needs it.
type event struct {
	*Event
	roots Roots
	once  sync.Once
	dev   *Device
	err   error
}

func (e *event) device() (*Device, error) {
	e.once.Do(func() {
		e.dev, e.err = e.roots.readDeviceEvent(e.roots.Sys.Path(e.DevPath), "", e.Event)
	})
	return e.dev, e.err
}

// WaitTrace tells how a Waiter found its device, for latency measurements.
type WaitTrace struct {
	Subscribed time.Time
	// KernelEvent and UdevEvent are the last events of the device received
	// after Subscribe (zero when none came, e.g. the device already existed).
	KernelEvent EventInfo
	UdevEvent   EventInfo
	// Matched is the event whose device matched (zero when found by a scan);
	// Considered is when the waiter began to read its device from sysfs.
	Matched    EventInfo
	Considered time.Time
	// Rejected counts the block events of a device of the wanted kind that
	// were read from sysfs but did not match (or had no device node yet).
	Rejected int
	// Found is when the device was matched and its node checked.
	Found time.Time
	// FromScan: found by the sysfs scan at the start of Wait, not by an event.
	FromScan bool
}

// Waiter waits for one device. It receives events from Subscribe on, so
// that nothing the caller's action causes can be missed.
type Waiter struct {
	l    *Listener
	m    Matcher
	kind string
	// A condition waiter (see subscribeUntil) has until set.
	until      func() bool
	untilName  string
	untilWhat  string
	subscribed time.Time

	// scanned, when set (tests), is called after the first sysfs scan.
	scanned func()

	mu     sync.Mutex
	queue  []*event
	rescan bool
	closed bool
	wake   chan struct{}
	trace  WaitTrace
}

func (w *Waiter) push(e *event) {
	w.mu.Lock()
	if !w.closed {
		w.queue = append(w.queue, e)
	}
	w.mu.Unlock()
	w.notify()
}

func (w *Waiter) setRescan() {
	w.mu.Lock()
	w.rescan = true
	w.mu.Unlock()
	w.notify()
}

func (w *Waiter) notify() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *Waiter) take() ([]*event, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	q, r := w.queue, w.rescan
	w.queue, w.rescan = nil, false
	return q, r
}

// Close unsubscribes the waiter. It is safe to call more than once.
func (w *Waiter) Close() {
	w.l.mu.Lock()
	delete(w.l.subs, w)
	w.l.mu.Unlock()
	w.mu.Lock()
	w.closed = true
	w.queue = nil
	w.mu.Unlock()
}

// Trace returns how the device was found; valid after Wait returned one.
func (w *Waiter) Trace() WaitTrace {
	w.mu.Lock()
	defer w.mu.Unlock()
	t := w.trace
	t.Subscribed = w.subscribed
	return t
}

func (w *Waiter) what() string {
	if w.until != nil {
		return w.untilWhat
	}
	if w.m == nil {
		return "nothing"
	}
	return w.m.String()
}

// Wait returns the matching device once it exists, its node is in place and,
// with udev, udev has finished processing it. It scans sysfs once, then
// reacts to events only. When ctx ends first the error wraps ctx.Err() and
// names what was waited for. A removal waiter returns (nil, nil) when the
// device is gone.
func (w *Waiter) Wait(ctx context.Context) (*Device, error) {
	w.mu.Lock()
	closed := w.closed
	w.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("wait for %s: waiter closed: %w", w.what(), errdefs.ErrFailedPrecondition)
	}
	fail := func(err error) (*Device, error) {
		return nil, fmt.Errorf("wait for %s: %w", w.what(), err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	scan := func() (*Device, bool, error) {
		if w.l.udev {
			if err := w.l.sync(ctx); err != nil {
				return nil, false, err
			}
		}
		return w.scan()
	}
	if d, ok, err := scan(); err != nil {
		return fail(err)
	} else if ok {
		return d, nil
	}
	if w.scanned != nil {
		w.scanned()
	}
	for {
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-w.l.done:
			return fail(w.l.closedErr())
		case <-w.wake:
		}
		q, rescan := w.take()
		if rescan {
			if d, ok, err := scan(); err != nil {
				return fail(err)
			} else if ok {
				return d, nil
			}
		}
		for _, e := range q {
			if d, ok := w.consider(e); ok {
				return d, nil
			}
		}
	}
}

// scan checks sysfs for the device.
func (w *Waiter) scan() (*Device, bool, error) {
	if w.until != nil {
		return nil, w.until(), nil
	}
	if w.m == nil {
		return nil, false, nil
	}
	var found *Device
	err := w.l.roots.scanBlock(w.kind, w.m, func(d *Device) bool {
		if !w.m.Match(d) || !w.l.nodeMatches(d) {
			return false
		}
		if w.l.udev && (!w.l.roots.udevInitialized(d.Major, d.Minor) || w.l.udevPending(d.Name)) {
			return false
		}
		found = d
		return true
	})
	if err != nil || found == nil {
		return nil, false, err
	}
	w.found(found, true)
	return found, true, nil
}

// consider checks one event.
func (w *Waiter) consider(e *event) (*Device, bool) {
	if w.until != nil {
		if e.Name() == w.untilName {
			return nil, w.until()
		}
		return nil, false
	}
	switch e.Action {
	case "add", "change", "online", "move":
	default:
		return nil, false
	}
	if w.m == nil || (e.DevType != "" && e.DevType != "disk") {
		return nil, false
	}
	if w.l.udev && e.Source != SourceUdev {
		return nil, false // udev has not finished with it yet
	}
	if w.kind != "" && !nameMayBeKind(e.Name(), w.kind) {
		return nil, false
	}
	considered := time.Now()
	d, err := e.device()
	if err != nil || !w.m.Match(d) || !w.l.nodeMatches(d) {
		w.mu.Lock()
		w.trace.Rejected++
		w.mu.Unlock()
		return nil, false
	}
	w.found(d, false)
	w.mu.Lock()
	w.trace.Matched = e.info()
	w.trace.Considered = considered
	w.mu.Unlock()
	return d, true
}

func (w *Waiter) found(d *Device, fromScan bool) {
	st := w.l.lastEvents(d.Name)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.trace.Found = time.Now()
	w.trace.FromScan = fromScan
	if st.kernel.Received.After(w.subscribed) {
		w.trace.KernelEvent = st.kernel
	}
	if st.udev.Received.After(w.subscribed) {
		w.trace.UdevEvent = st.udev
	}
}

// isGone reports whether dev no longer exists: its name is gone or now
// belongs to another device.
func isGone(dev *Device) bool {
	d, err := dev.roots.Lookup(dev.Name)
	if err != nil {
		return errors.Is(err, errdefs.ErrNotFound)
	}
	return d.Major != dev.Major || d.Minor != dev.Minor ||
		(d.DiskSeq != 0 && dev.DiskSeq != 0 && d.DiskSeq != dev.DiskSeq)
}
