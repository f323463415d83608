package devices

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Source says who sent a uevent.
type Source uint8

const (
	// SourceKernel: the kernel's own message (netlink group 1).
	SourceKernel Source = 1
	// SourceUdev: systemd-udevd's message after its rules ran (group 2).
	SourceUdev Source = 2
)

func (s Source) String() string {
	switch s {
	case SourceKernel:
		return "kernel"
	case SourceUdev:
		return "udev"
	}
	return "source(" + strconv.Itoa(int(s)) + ")"
}

// Event is one parsed uevent.
type Event struct {
	Source    Source
	Action    string // "add", "change", "remove", "move", "online", "offline", "bind", "unbind"
	DevPath   string // sysfs path below /sys: "/devices/virtual/block/loop3"
	Subsystem string
	DevType   string // "disk", "partition", …
	// DevName is the node name: relative to /dev in kernel events ("loop3"),
	// absolute in udev events ("/dev/loop3").
	DevName      string
	Major, Minor uint32
	HasDevNum    bool
	Seqnum       uint64
	Env          map[string]string // every KEY=VALUE of the message
	Received     time.Time         // set by the listener; zero from the parser
}

// EventInfo is the part of an event a metrics hook or a WaitTrace keeps.
type EventInfo struct {
	Source   Source
	Action   string
	DevPath  string
	Seqnum   uint64
	Received time.Time
}

func (e *Event) info() EventInfo {
	return EventInfo{Source: e.Source, Action: e.Action, DevPath: e.DevPath, Seqnum: e.Seqnum, Received: e.Received}
}

// Name returns the kernel name of the device (the last element of DevPath).
func (e *Event) Name() string { return devPathName(e.DevPath) }

// Name returns the kernel name of the device (the last element of DevPath).
func (e EventInfo) Name() string { return devPathName(e.DevPath) }

func devPathName(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[i+1:]
	}
	return p
}

// udev's netlink header ("libudev\0", magic, then offsets), see
// sd-device/device-monitor.c: the magic is big endian, the other fields are
// in the sender's byte order, which on a netlink socket is ours.
const (
	udevPrefix       = "libudev\x00"
	udevMagic        = 0xfeedcafe
	udevHeaderMinLen = 24 // prefix, magic, header_size, properties_off, properties_len
)

var errNotUevent = errors.New("not a uevent message")

// ParseUevent parses one message received on a NETLINK_KOBJECT_UEVENT
// socket: either the kernel's "action@devpath\0KEY=VALUE\0…" or udev's
// binary message (a "libudev" header followed by KEY=VALUE\0 properties).
func ParseUevent(msg []byte) (*Event, error) {
	if bytes.HasPrefix(msg, []byte(udevPrefix)) {
		return parseUdevMessage(msg)
	}
	return parseKernelMessage(msg)
}

func parseKernelMessage(msg []byte) (*Event, error) {
	head, rest, ok := bytes.Cut(msg, []byte{0})
	if !ok {
		return nil, fmt.Errorf("kernel uevent: no NUL after the header: %w", errNotUevent)
	}
	action, devpath, ok := strings.Cut(string(head), "@")
	if !ok || action == "" || !strings.HasPrefix(devpath, "/") {
		return nil, fmt.Errorf("kernel uevent: header %q is not action@devpath: %w", truncate(head), errNotUevent)
	}
	ev, err := parseProperties(rest)
	if err != nil {
		return nil, fmt.Errorf("kernel uevent %s@%s: %w", action, devpath, err)
	}
	if ev.Action != action || ev.DevPath != devpath {
		return nil, fmt.Errorf("kernel uevent %s@%s: properties say %s@%s", action, devpath, ev.Action, ev.DevPath)
	}
	ev.Source = SourceKernel
	return ev, nil
}

func parseUdevMessage(msg []byte) (*Event, error) {
	if len(msg) < udevHeaderMinLen {
		return nil, fmt.Errorf("udev message: %d bytes is shorter than its header: %w", len(msg), errNotUevent)
	}
	if m := binary.BigEndian.Uint32(msg[8:12]); m != udevMagic {
		return nil, fmt.Errorf("udev message: magic %#x, want %#x: %w", m, udevMagic, errNotUevent)
	}
	hdrSize := binary.NativeEndian.Uint32(msg[12:16])
	off := binary.NativeEndian.Uint32(msg[16:20])
	n := binary.NativeEndian.Uint32(msg[20:24])
	if hdrSize < udevHeaderMinLen || off < hdrSize || uint64(off)+uint64(n) > uint64(len(msg)) {
		return nil, fmt.Errorf("udev message: header size %d, properties at %d+%d in %d bytes: %w",
			hdrSize, off, n, len(msg), errNotUevent)
	}
	ev, err := parseProperties(msg[off : off+n])
	if err != nil {
		return nil, fmt.Errorf("udev message: %w", err)
	}
	ev.Source = SourceUdev
	return ev, nil
}

// parseProperties parses KEY=VALUE pairs separated by NUL bytes.
func parseProperties(b []byte) (*Event, error) {
	ev := &Event{Env: make(map[string]string, 12)}
	for len(b) > 0 {
		var kv []byte
		kv, b, _ = bytes.Cut(b, []byte{0})
		if len(kv) == 0 {
			continue
		}
		k, v, ok := bytes.Cut(kv, []byte{'='})
		if !ok || len(k) == 0 {
			return nil, fmt.Errorf("property %q is not KEY=VALUE", truncate(kv))
		}
		ev.Env[string(k)] = string(v)
	}
	ev.Action = ev.Env["ACTION"]
	ev.DevPath = ev.Env["DEVPATH"]
	ev.Subsystem = ev.Env["SUBSYSTEM"]
	ev.DevType = ev.Env["DEVTYPE"]
	ev.DevName = ev.Env["DEVNAME"]
	if ev.Action == "" || ev.DevPath == "" || ev.Subsystem == "" {
		return nil, errors.New("ACTION, DEVPATH or SUBSYSTEM missing")
	}
	if !strings.HasPrefix(ev.DevPath, "/") || strings.Contains(ev.DevPath, "/../") || strings.HasSuffix(ev.DevPath, "/..") {
		return nil, fmt.Errorf("DEVPATH %q is not a sysfs path", ev.DevPath)
	}
	if s, ok := ev.Env["SEQNUM"]; ok {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("SEQNUM %q: %w", s, err)
		}
		ev.Seqnum = n
	}
	maj, hasMaj := ev.Env["MAJOR"]
	min, hasMin := ev.Env["MINOR"]
	if hasMaj && hasMin {
		a, err1 := strconv.ParseUint(maj, 10, 32)
		b, err2 := strconv.ParseUint(min, 10, 32)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("MAJOR %q MINOR %q: %w", maj, min, err)
		}
		ev.Major, ev.Minor, ev.HasDevNum = uint32(a), uint32(b), true
	}
	return ev, nil
}

func truncate(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "…"
	}
	return string(b)
}
