package systemd

import (
	"fmt"
	"net"
	"path/filepath"

	"github.com/coreos/go-systemd/v22/activation"

	"github.com/berth-csi/berth/internal/errdefs"
)

// Listener returns the unix stream socket systemd passed to this process
// (LISTEN_FDS, see sd_listen_fds(3)), or nil when nothing was passed and the
// caller should create its own listener.
//
// When wantPath is not empty, the passed socket must be bound to that path:
// a socket unit whose ListenStream= differs from --endpoint would serve on a
// path the kubelet never dials, so that is reported instead of ignored.
// The LISTEN_* variables are cleared so that child processes (mkfs,
// iscsiadm) do not see descriptors that are not theirs.
func Listener(wantPath string) (net.Listener, error) {
	files := activation.Files(true)
	switch len(files) {
	case 0:
		return nil, nil
	case 1:
	default:
		for _, f := range files {
			f.Close()
		}
		return nil, fmt.Errorf("socket activation: %d sockets passed, berth serves exactly one (check ListenStream= in berth.socket): %w",
			len(files), errdefs.ErrInvalidArgument)
	}
	f := files[0]
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("socket activation: descriptor %d (%s) is not a listening socket: %w", f.Fd(), f.Name(), err)
	}
	addr := l.Addr()
	if addr.Network() != "unix" {
		l.Close()
		return nil, fmt.Errorf("socket activation: passed socket is %s %s, berth serves only unix stream sockets: %w",
			addr.Network(), addr.String(), errdefs.ErrInvalidArgument)
	}
	if wantPath != "" && filepath.Clean(addr.String()) != filepath.Clean(wantPath) {
		l.Close()
		return nil, fmt.Errorf("socket activation: passed socket is bound to %q but the endpoint is %q (make ListenStream= and --endpoint agree): %w",
			addr.String(), wantPath, errdefs.ErrInvalidArgument)
	}
	// The socket file belongs to the socket unit: closing the listener
	// must not unlink it, or a restarted berth would find no socket.
	if ul, ok := l.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	return l, nil
}
