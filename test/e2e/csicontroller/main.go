// Command csicontroller is the CSI controller make e2e runs beside berth, so
// that external-provisioner and external-resizer can give the Kubernetes
// storage suite dynamically provisioned berth volumes: berth is a node-only
// plugin, and the suite tests no pre-provisioned volumes.
//
// It serves Identity and Controller for the file transport only: a volume is
// a sparse image file NAME.img in berth's --file-root (volume_context
// transport=file, file=NAME.img); DeleteVolume removes it;
// ControllerExpandVolume grows it (truncate, never shrinks) and leaves the
// filesystem to berth's NodeExpandVolume. It is a test fixture, not a
// product: one node, no topology, no snapshots.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"sync"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

const (
	defaultSize = 1 << 30
	// sizeUnit rounds every volume up, so a loop device's size is a whole
	// number of filesystem blocks.
	sizeUnit = 1 << 20
)

// names the controller accepts as volume names and IDs: what
// external-provisioner sends (pvc-<uid>), nothing that could leave the root.
var validName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,127}$`)

type controller struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	driver string
	root   string
	log    *slog.Logger
	mu     sync.Mutex // one operation at a time: a test fixture
}

func main() {
	endpoint := flag.String("endpoint", "", "unix socket to serve (path)")
	driver := flag.String("driver-name", "berth.csi.io", "CSI driver name, as berth's")
	root := flag.String("file-root", "", "berth's --file-root: where the image files go")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if *endpoint == "" || !filepath.IsAbs(*root) {
		fmt.Fprintln(os.Stderr, "usage: csicontroller -endpoint PATH -file-root /ABS/DIR [-driver-name NAME]")
		os.Exit(2)
	}
	if err := serve(*endpoint, &controller{driver: *driver, root: *root, log: log}); err != nil {
		log.Error("csicontroller", "err", err)
		os.Exit(1)
	}
}

func serve(endpoint string, c *controller) error {
	if err := os.MkdirAll(c.root, 0o755); err != nil {
		return err
	}
	if err := os.Remove(endpoint); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	l, err := net.Listen("unix", endpoint)
	if err != nil {
		return err
	}
	s := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		c.log.Info("rpc", "method", info.FullMethod, "code", status.Code(err).String(), "err", err)
		return resp, err
	}))
	csi.RegisterIdentityServer(s, c)
	csi.RegisterControllerServer(s, c)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() { <-ctx.Done(); s.GracefulStop() }()
	c.log.Info("serving", "endpoint", endpoint, "file_root", c.root)
	return s.Serve(l)
}

func (c *controller) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: c.driver, VendorVersion: "e2e"}, nil
}

func (c *controller) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{
		{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}},
		{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE}}},
	}}, nil
}

func (c *controller) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (c *controller) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// path is the image file of volume id, which is checked to be a plain name.
func (c *controller) path(id string) (string, error) {
	if !validName.MatchString(id) {
		return "", status.Errorf(codes.InvalidArgument, "volume %q: want a name of lower-case letters, digits and dashes", id)
	}
	return filepath.Join(c.root, id+".img"), nil
}

// size is the bytes a volume gets for r: the required bytes (default 1 GiB)
// rounded up to whole MiB, within the limit.
func size(r *csi.CapacityRange) (int64, error) {
	want, limit := int64(defaultSize), int64(0)
	if r != nil {
		limit = r.GetLimitBytes()
		if r.GetRequiredBytes() > 0 {
			want = r.GetRequiredBytes()
		} else if limit > 0 && limit < want {
			want = limit
		}
	}
	if want < 0 || limit < 0 {
		return 0, status.Error(codes.InvalidArgument, "capacity range: negative bytes")
	}
	want = (want + sizeUnit - 1) / sizeUnit * sizeUnit
	if limit > 0 && want > limit {
		return 0, status.Errorf(codes.OutOfRange, "capacity range: %d bytes rounded up to whole MiB exceed the limit %d", want, limit)
	}
	return want, nil
}

func checkCaps(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "no volume capabilities")
	}
	for _, vc := range caps {
		if vc.GetBlock() == nil && vc.GetMount() == nil {
			return status.Error(codes.InvalidArgument, "volume capability: neither block nor mount")
		}
		switch vc.GetAccessMode().GetMode() {
		case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:
		default:
			return status.Errorf(codes.InvalidArgument, "access mode %s: a file volume is on one node", vc.GetAccessMode().GetMode())
		}
	}
	return nil
}

func (c *controller) volume(id string, bytes int64) *csi.Volume {
	return &csi.Volume{
		VolumeId:      id,
		CapacityBytes: bytes,
		VolumeContext: map[string]string{"transport": "file", "file": id + ".img"},
	}
}

func (c *controller) CreateVolume(_ context.Context, r *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if r.GetVolumeContentSource() != nil {
		return nil, status.Error(codes.InvalidArgument, "volume content sources (snapshots, clones) are not supported")
	}
	if err := checkCaps(r.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	p, err := c.path(r.GetName())
	if err != nil {
		return nil, err
	}
	want, err := size(r.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if fi, err := os.Stat(p); err == nil {
		// A retry: the same volume if its size fits the request.
		limit := r.GetCapacityRange().GetLimitBytes()
		if fi.Size() < want || (limit > 0 && fi.Size() > limit) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with %d bytes", r.GetName(), fi.Size())
		}
		return &csi.CreateVolumeResponse{Volume: c.volume(r.GetName(), fi.Size())}, nil
	}
	f, err := os.OpenFile(p+".tmp", os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "create %s: %v", p, err)
	}
	err = f.Truncate(want)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(p+".tmp", p)
	}
	if err != nil {
		os.Remove(p + ".tmp")
		return nil, status.Errorf(codes.Internal, "create %s: %v", p, err)
	}
	return &csi.CreateVolumeResponse{Volume: c.volume(r.GetName(), want)}, nil
}

func (c *controller) DeleteVolume(_ context.Context, r *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	p, err := c.path(r.GetVolumeId())
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "delete %s: %v", p, err)
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (c *controller) ControllerExpandVolume(_ context.Context, r *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	p, err := c.path(r.GetVolumeId())
	if err != nil {
		return nil, err
	}
	want, err := size(r.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	fi, err := os.Stat(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.NotFound, "volume %q: no image file", r.GetVolumeId())
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "expand %s: %v", p, err)
	}
	if fi.Size() < want {
		if err := os.Truncate(p, want); err != nil {
			return nil, status.Errorf(codes.Internal, "expand %s: %v", p, err)
		}
	} else {
		want = fi.Size()
	}
	// A block volume needs no filesystem grown, but berth re-reads the loop
	// device's size in NodeExpandVolume either way.
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: want, NodeExpansionRequired: true}, nil
}

func (c *controller) ValidateVolumeCapabilities(_ context.Context, r *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	p, err := c.path(r.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(p); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %q: %v", r.GetVolumeId(), err)
	}
	if err := checkCaps(r.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeCapabilities: r.GetVolumeCapabilities(),
	}}, nil
}
