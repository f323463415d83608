// Package kubeletreg registers berth with the kubelet through the
// kubelet's plugin registration API (pluginregistration v1), the job
// node-driver-registrar does beside a CSI driver in a pod.
//
// The kubelet watches <kubelet-dir>/plugins_registry for sockets. For each
// new one it calls GetInfo, learns the driver's name and CSI endpoint,
// dials that endpoint (NodeGetInfo), records the driver in the node's
// CSINode object and answers with NotifyRegistrationStatus. A refused
// registration is not retried by the kubelet on its own: the plugin must
// offer itself again, which it does by creating its socket anew. When the
// socket goes away, the kubelet unregisters the driver.
package kubeletreg

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// SupportedVersions are the CSI versions berth offers the kubelet; the
// kubelet's CSI plugin accepts 1.x.
var SupportedVersions = []string{"1.0.0"}

// Backoff bounds between a refused registration and the next offer.
const (
	DefaultBackoff = 5 * time.Second
	MaxBackoff     = 5 * time.Minute
)

// Config says what to register and where.
type Config struct {
	// KubeletDir is the kubelet's root directory.
	KubeletDir string
	// DriverName is the CSI driver name (GetPluginInfo's name).
	DriverName string
	// Endpoint is the path of berth's CSI socket as the kubelet sees it.
	Endpoint string
	Logger   *slog.Logger
	// Backoff is the wait after the first refused registration; it doubles
	// with each refusal in a row, up to MaxBackoff. Zero: DefaultBackoff.
	Backoff time.Duration
}

// SocketPath is the registration socket of driver under kubeletDir.
func SocketPath(kubeletDir, driver string) string {
	return filepath.Join(kubeletDir, "plugins_registry", driver+"-reg.sock")
}

// Registrar serves the registration API on its socket.
type Registrar struct {
	cfg  Config
	path string
	log  *slog.Logger
	lis  net.Listener

	mu     sync.Mutex // held to replace the pending status
	status chan *registerapi.RegistrationStatus
}

// Listen checks cfg and creates the registration socket, so that a
// kubelet directory berth cannot write to stops berth at startup rather
// than later. A stale socket (left by a berth that was killed) is
// replaced; a socket another server answers on is not.
func Listen(cfg Config) (*Registrar, error) {
	if cfg.DriverName == "" || cfg.Endpoint == "" || !filepath.IsAbs(cfg.KubeletDir) || !filepath.IsAbs(cfg.Endpoint) {
		return nil, fmt.Errorf("kubelet registration: want an absolute kubelet directory (%q) and endpoint (%q) and a driver name (%q)",
			cfg.KubeletDir, cfg.Endpoint, cfg.DriverName)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Backoff <= 0 {
		cfg.Backoff = DefaultBackoff
	}
	r := &Registrar{
		cfg:    cfg,
		path:   SocketPath(cfg.KubeletDir, cfg.DriverName),
		log:    cfg.Logger.With(slog.String("registration_socket", SocketPath(cfg.KubeletDir, cfg.DriverName))),
		status: make(chan *registerapi.RegistrationStatus, 1),
	}
	lis, err := r.listen()
	if err != nil {
		return nil, err
	}
	r.lis = lis
	return r, nil
}

// Path is the registration socket.
func (r *Registrar) Path() string { return r.path }

func (r *Registrar) listen() (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(r.path), 0o750); err != nil {
		return nil, fmt.Errorf("kubelet registration: create %s: %w (is --kubelet-dir the kubelet's root directory?)", filepath.Dir(r.path), err)
	}
	fi, err := os.Lstat(r.path)
	switch {
	case err == nil && fi.Mode().Type() != fs.ModeSocket:
		return nil, fmt.Errorf("kubelet registration: %s exists and is not a socket; remove it if it is not needed", r.path)
	case err == nil:
		if c, derr := net.DialTimeout("unix", r.path, time.Second); derr == nil {
			c.Close()
			return nil, fmt.Errorf("kubelet registration: another server (node-driver-registrar, another berth?) answers on %s; run only one registrar for %s", r.path, r.cfg.DriverName)
		}
		if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("kubelet registration: remove stale socket %s: %w", r.path, err)
		}
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("kubelet registration: %w", err)
	}
	lis, err := net.Listen("unix", r.path)
	if err != nil {
		return nil, fmt.Errorf("kubelet registration: %w", err)
	}
	// Only the kubelet (root) needs it. Closing the listener unlinks it.
	if err := os.Chmod(r.path, 0o600); err != nil {
		lis.Close()
		return nil, fmt.Errorf("kubelet registration: %w", err)
	}
	return lis, nil
}

// Serve answers the kubelet until ctx ends, then removes the socket. After
// a refused registration it waits (backing off), removes the socket and
// creates it again, so that the kubelet's plugin watcher offers berth to
// the kubelet once more. It returns nil when ctx ends.
func (r *Registrar) Serve(ctx context.Context) error {
	backoff := r.cfg.Backoff
	lis := r.lis
	for {
		srv := grpc.NewServer()
		registerapi.RegisterRegistrationServer(srv, &server{r: r})
		served := make(chan error, 1)
		go func() { served <- srv.Serve(lis) }()
		r.log.Info("offering the driver to the kubelet", slog.String("driver", r.cfg.DriverName), slog.String("csi_endpoint", r.cfg.Endpoint))

		var refused bool
	wait:
		for {
			select {
			case <-ctx.Done():
				srv.Stop()
				<-served
				r.removeSocket()
				return nil
			case err := <-served:
				// The listener failed under the server: offer again.
				r.log.Error("registration server stopped", slog.String("error", err.Error()))
				refused = true
				break wait
			case st := <-r.status:
				if st.PluginRegistered {
					r.log.Info("registered with the kubelet", slog.String("driver", r.cfg.DriverName))
					backoff = r.cfg.Backoff
					continue
				}
				r.log.Error("the kubelet refused the registration; offering again",
					slog.String("driver", r.cfg.DriverName), slog.String("error", st.Error), slog.Duration("retry_in", backoff))
				refused = true
				break wait
			}
		}
		if refused {
			// The answer to NotifyRegistrationStatus is on its way; then
			// the socket goes, so the kubelet forgets this offer.
			stopGracefully(srv, gracePeriod)
			r.removeSocket()
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, MaxBackoff)
			for {
				var err error
				if lis, err = r.listen(); err == nil {
					break
				}
				r.log.Error("recreate the registration socket", slog.String("error", err.Error()), slog.Duration("retry_in", backoff))
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, MaxBackoff)
			}
		}
	}
}

// gracePeriod bounds the wait for RPCs in flight when the socket is
// recreated.
const gracePeriod = 5 * time.Second

func stopGracefully(srv *grpc.Server, within time.Duration) {
	done := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(within)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		srv.Stop()
		<-done
	}
}

func (r *Registrar) removeSocket() {
	if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		r.log.Warn("remove the registration socket", slog.String("error", err.Error()))
	}
}

type server struct {
	registerapi.UnimplementedRegistrationServer
	r *Registrar
}

func (s *server) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.r.cfg.DriverName,
		Endpoint:          s.r.cfg.Endpoint,
		SupportedVersions: SupportedVersions,
	}, nil
}

func (s *server) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	// Only the latest answer matters; Serve acts on it. The send never
	// blocks: the channel was emptied under the lock.
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	select {
	case <-s.r.status:
	default:
	}
	s.r.status <- st
	return &registerapi.RegistrationStatusResponse{}, nil
}
