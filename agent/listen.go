package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/berth-csi/berth/internal/lockfile"
)

// SocketPath returns the filesystem path of a CSI endpoint:
// "unix:///run/berth/csi.sock", "unix:/run/berth/csi.sock" or a plain
// absolute path. Other schemes are refused: CSI plugins talk to the CO
// over a local socket.
func SocketPath(endpoint string) (string, error) {
	p := endpoint
	switch {
	case strings.HasPrefix(p, "unix://"):
		p = strings.TrimPrefix(p, "unix://")
	case strings.HasPrefix(p, "unix:"):
		p = strings.TrimPrefix(p, "unix:")
	case strings.Contains(p, "://"):
		return "", fmt.Errorf("endpoint %q: only unix sockets are supported", endpoint)
	}
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || hasControl(p) {
		return "", fmt.Errorf("endpoint %q: want an absolute, clean socket path", endpoint)
	}
	return p, nil
}

// Listen creates the unix socket of endpoint with mode 0660. It first
// takes the endpoint's lock, a file beside the socket (csi.sock.lock),
// held until the listener is closed: a second berth on the endpoint is
// refused, naming the holder's pid, before it looks at the socket. A
// stale socket left by a crashed agent is replaced; if another server
// (not a berth, or one without the lock) answers on it, Listen refuses
// rather than steal its socket. The socket file is bound under a
// temporary name and renamed into place, so it never exists with a wider
// mode.
func Listen(endpoint string) (_ net.Listener, retErr error) {
	path, err := SocketPath(endpoint)
	if err != nil {
		return nil, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
	lock, err := lockEndpoint(path)
	if err != nil {
		return nil, err
	}
	defer func() {
		if retErr != nil {
			lock.Close()
		}
	}()
	fi, err := os.Lstat(path)
	switch {
	case err == nil && fi.Mode().Type() != fs.ModeSocket:
		return nil, fmt.Errorf("endpoint %s: exists and is not a socket; remove it if it is not needed", path)
	case err == nil:
		c, derr := net.DialTimeout("unix", path, time.Second)
		if derr == nil {
			c.Close()
			return nil, fmt.Errorf("endpoint %s: another server is listening on it; stop it first", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("endpoint %s: %w", path, err)
	}
	tmp := filepath.Join(dir, fmt.Sprintf(".%s.%d.tmp", filepath.Base(path), os.Getpid()))
	_ = os.Remove(tmp)
	l, err := net.Listen("unix", tmp)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false)
	fail := func(err error) (net.Listener, error) {
		ul.Close()
		os.Remove(tmp)
		return nil, err
	}
	if err := os.Chmod(tmp, 0o660); err != nil {
		return fail(fmt.Errorf("set mode of socket %s: %w", path, err))
	}
	// The rename keeps the inode: Close compares it to tell this
	// listener's socket file from one another server put at the path.
	created, err := os.Lstat(tmp)
	if err != nil {
		return fail(fmt.Errorf("stat socket %s: %w", path, err))
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(fmt.Errorf("move socket into place at %s: %w", path, err))
	}
	return &unixListener{UnixListener: ul, path: path, file: created, lock: lock}, nil
}

// LockListener takes the endpoint lock (see Listen) for a listener berth
// did not create, one systemd passed (socket activation), so that a
// second berth asked to listen on the same path is refused and names this
// process. Closing the returned listener closes l and releases the lock;
// the socket file belongs to the socket unit and stays.
func LockListener(l net.Listener, path string) (net.Listener, error) {
	lock, err := lockEndpoint(path)
	if err != nil {
		return nil, err
	}
	return &lockedListener{Listener: l, lock: lock}, nil
}

func lockEndpoint(path string) (*lockfile.Lock, error) {
	l, err := lockfile.Acquire(path + ".lock")
	var locked *lockfile.HeldError
	if errors.As(err, &locked) {
		return nil, fmt.Errorf("endpoint %s is in use by another berth: %w; stop it first", path, err)
	}
	return l, err
}

type lockedListener struct {
	net.Listener
	lock *lockfile.Lock
}

func (l *lockedListener) Close() error {
	err := l.Listener.Close()
	l.lock.Close()
	return err
}

// unixListener removes its socket file when closed, if the file at the
// path is still the one it created, then releases the endpoint lock.
// Addr reports the final path, not the temporary one it was bound under.
type unixListener struct {
	*net.UnixListener
	path string
	file os.FileInfo // the socket file as created
	lock *lockfile.Lock
	once sync.Once
}

func (l *unixListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	l.once.Do(func() {
		if fi, err := os.Lstat(l.path); err == nil && os.SameFile(fi, l.file) {
			os.Remove(l.path)
		}
		l.lock.Close()
	})
	return err
}
