package devices

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Netlink multicast groups of NETLINK_KOBJECT_UEVENT.
const (
	groupKernel = 1
	groupUdev   = 2
)

const (
	defaultRcvbuf = 32 << 20
	// A kernel uevent is at most 2 KiB; udev's messages carry more
	// properties but stay well below this.
	maxMessage = 64 << 10
)

// syncMarker starts the messages the listener sends to itself; it cannot be
// the start of a uevent ("action@…") or a udev message ("libudev\0").
var syncMarker = []byte("\x00berth-sync ")

// ueventConn is the listener's netlink socket, driven by the Go runtime's
// poller so that Close wakes a blocked receive.
type ueventConn struct {
	f    *os.File
	rc   syscall.RawConn
	fd   int
	self uint32 // our netlink port ID
}

// NewListener opens the uevent socket and starts receiving. It joins udev's
// group as well as the kernel's when systemd-udevd runs on the node (see
// WithUdev).
func NewListener(opts ...ListenerOption) (*Listener, error) {
	cfg := listenerConfig{rcvbuf: defaultRcvbuf}
	for _, o := range opts {
		o(&cfg)
	}
	udev := cfg.udev > 0
	if cfg.udev == 0 {
		_, err := os.Stat(filepath.Join(cfg.roots.udevRun(), "control"))
		udev = err == nil
	}
	groups := uint32(groupKernel)
	if udev {
		groups |= groupUdev
	}
	conn, err := openUevent(groups, cfg.rcvbuf)
	if err != nil {
		return nil, err
	}
	l := newListener(cfg, udev)
	l.conn = conn
	go l.receive()
	return l, nil
}

func openUevent(groups uint32, rcvbuf int) (_ *ueventConn, retErr error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_KOBJECT_UEVENT)
	if err != nil {
		return nil, fmt.Errorf("open uevent netlink socket: %w", err)
	}
	defer func() {
		if retErr != nil {
			unix.Close(fd)
		}
	}()
	if rcvbuf > 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, rcvbuf); err != nil {
			// Without CAP_NET_ADMIN the limit is net.core.rmem_max.
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, rcvbuf); err != nil {
				return nil, fmt.Errorf("uevent socket: set receive buffer: %w", err)
			}
		}
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		return nil, fmt.Errorf("uevent socket: SO_PASSCRED: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: groups}); err != nil {
		if errors.Is(err, unix.EPERM) {
			return nil, fmt.Errorf("uevent socket: join groups %#x: %w (%w)", groups, err, errdefs.ErrPermissionDenied)
		}
		return nil, fmt.Errorf("uevent socket: join groups %#x: %w", groups, err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return nil, fmt.Errorf("uevent socket: getsockname: %w", err)
	}
	nl, ok := sa.(*unix.SockaddrNetlink)
	if !ok {
		return nil, fmt.Errorf("uevent socket: unexpected address %T", sa)
	}
	f := os.NewFile(uintptr(fd), "uevent")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("uevent socket: %w", err)
	}
	return &ueventConn{f: f, rc: rc, fd: fd, self: nl.Pid}, nil
}

// sendMarker queues a barrier message on our own socket.
func (c *ueventConn) sendMarker(id uint64) error {
	msg := strconv.AppendUint(append([]byte(nil), syncMarker...), id, 10)
	var err error
	cerr := c.rc.Write(func(fd uintptr) bool {
		err = unix.Sendto(int(fd), msg, unix.MSG_DONTWAIT, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Pid: c.self})
		return true
	})
	if cerr != nil {
		return cerr
	}
	return err
}

func isQueueFull(err error) bool {
	return errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.ENOBUFS)
}

// Close stops the listener; pending and later Waits return an error wrapping
// ErrListenerClosed.
func (l *Listener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		l.stop(ErrListenerClosed)
		if l.conn != nil {
			err = l.conn.f.Close()
			<-l.done
		} else {
			close(l.done)
		}
	})
	return err
}

// receive reads messages until the socket is closed.
func (l *Listener) receive() {
	defer close(l.done)
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(unix.SizeofUcred))
	var fatal error
	read := func(fd uintptr) bool {
		for {
			n, oobn, flags, from, err := unix.Recvmsg(int(fd), buf, oob, unix.MSG_DONTWAIT)
			switch {
			case err == nil:
			case errors.Is(err, unix.EAGAIN):
				l.markSynced(0)
				return false // wait for the poller
			case errors.Is(err, unix.EINTR):
				continue
			case errors.Is(err, unix.ENOBUFS):
				l.overflow()
				continue
			default:
				fatal = err
				return true
			}
			now := time.Now()
			if flags&unix.MSG_TRUNC != 0 {
				l.log.Warn("uevent message truncated; dropped", "size", n)
				continue
			}
			nl, ok := from.(*unix.SockaddrNetlink)
			if !ok {
				continue
			}
			l.handle(buf[:n], nl, senderUID(oob[:oobn]), now)
		}
	}
	for fatal == nil {
		if err := l.conn.rc.Read(read); err != nil {
			fatal = err
		}
	}
	l.mu.Lock()
	closing := l.err != nil
	l.mu.Unlock()
	if !closing {
		l.log.Error("uevent listener stopped", "error", fatal)
	}
	l.stop(fmt.Errorf("receive uevents: %w", fatal))
}

// handle authenticates one message by its sender and dispatches it: kernel
// messages come from port 0 on group 1, udev's from a root process on group
// 2, barriers from ourselves. Anything else is dropped.
func (l *Listener) handle(msg []byte, from *unix.SockaddrNetlink, uid int64, now time.Time) {
	switch {
	case from.Groups == 0 && from.Pid == l.conn.self:
		if id, ok := bytes.CutPrefix(msg, syncMarker); ok {
			if n, err := strconv.ParseUint(string(id), 10, 64); err == nil {
				l.markSynced(n)
			}
		}
		return
	case from.Groups&groupKernel != 0 && from.Pid == 0:
		if bytes.HasPrefix(msg, []byte(udevPrefix)) {
			return
		}
	case from.Groups&groupUdev != 0 && from.Pid != 0 && uid == 0 && l.udev:
		if !bytes.HasPrefix(msg, []byte(udevPrefix)) {
			return
		}
	default:
		return
	}
	ev, err := ParseUevent(msg)
	if err != nil {
		l.log.Debug("uevent dropped", "error", err)
		return
	}
	ev.Received = now
	l.dispatch(ev)
}

// senderUID returns the uid in an SCM_CREDENTIALS message, or -1.
func senderUID(oob []byte) int64 {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1
	}
	for _, m := range msgs {
		if m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SCM_CREDENTIALS {
			if c, err := unix.ParseUnixCredentials(&m); err == nil {
				return int64(c.Uid)
			}
		}
	}
	return -1
}

// nodeMatches reports whether d.Path is a block device node with d's
// number that the kernel lets open. A new disk shows in sysfs, and its
// node in devtmpfs, before the kernel makes it openable (its add uevent
// comes after that): a sysfs scan can find it in between, when an open
// fails with ENXIO, as it does again while a disk is being deleted.
// Such a disk is left for its uevent.
func nodeMatches(d *Device) bool {
	maj, min, err := statBlockNode(d.Path)
	if err != nil || maj != d.Major || min != d.Minor {
		return false
	}
	fd, err := unix.Open(d.Path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return !errors.Is(err, unix.ENXIO)
	}
	unix.Close(fd)
	return true
}

func statBlockNode(path string) (uint32, uint32, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, 0, fmt.Errorf("%s is not a block device node", path)
	}
	return unix.Major(st.Rdev), unix.Minor(st.Rdev), nil
}
