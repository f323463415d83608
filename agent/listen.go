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

// Listen creates the unix socket of endpoint with mode 0660. A stale
// socket left by a crashed agent is replaced; if another server answers
// on it, Listen refuses rather than steal its socket. The socket file is
// bound under a temporary name and renamed into place, so it never
// exists with a wider mode.
func Listen(endpoint string) (net.Listener, error) {
	path, err := SocketPath(endpoint)
	if err != nil {
		return nil, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
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
	if err := os.Chmod(tmp, 0o660); err != nil {
		ul.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("set mode of socket %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		ul.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("move socket into place at %s: %w", path, err)
	}
	return &unixListener{UnixListener: ul, path: path}, nil
}

// unixListener removes its socket file when closed. Addr reports the
// final path, not the temporary one it was bound under.
type unixListener struct {
	*net.UnixListener
	path string
	once sync.Once
}

func (l *unixListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	l.once.Do(func() { os.Remove(l.path) })
	return err
}
