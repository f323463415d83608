package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// PublishContextNode is the publish_context key of ControllerPublishVolume's
// answer: the node ID the CO published the volume to. The CO hands it back
// unchanged in NodeStageVolume's publish_context (Kubernetes keeps it in
// the VolumeAttachment's status.attachmentMetadata), so that a stage can
// tell that the attach it runs under was made for this node, and that the
// cluster runs with attach at all (a CSIDriver with attachRequired: false
// sends no publish_context).
const PublishContextNode = "berth.csi.io/node"

// ControllerConfig is what berth controller serves with.
type ControllerConfig struct {
	// DriverName is reported by GetPluginInfo; default DefaultDriverName.
	// It must be the node plugins' name: the external-attacher handles
	// the VolumeAttachments of the driver it finds here.
	DriverName string
	// Version is reported as vendor_version.
	Version string
	// Logger receives the requests' logs; default slog.Default().
	Logger *slog.Logger
	// Interceptors run around every RPC after berth's own logging one.
	Interceptors []grpc.UnaryServerInterceptor
	// ShutdownTimeout bounds how long Serve waits for RPCs in flight
	// when ctx ends; default 30s.
	ShutdownTimeout time.Duration
}

// Controller serves the CSI Identity and Controller services of berth
// controller, which the external-attacher calls for each VolumeAttachment
// of berth's volumes. It attaches nothing: berth's nodes attach the
// storage themselves at NodeStageVolume. What it gives the cluster is the
// attach step itself: with attachRequired: true, Kubernetes' attach-detach
// controller refuses to attach a single-node volume to a second node while
// a first has it (Multi-Attach error), which it does not check at all for
// drivers without attach. It keeps no state and needs no access to the
// storage, so every call is idempotent by construction.
type Controller struct {
	cfg   ControllerConfig
	log   *slog.Logger
	ready atomic.Bool
}

// NewController checks cfg and returns a Controller.
func NewController(cfg ControllerConfig) (*Controller, error) {
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if !driverNameRe.MatchString(cfg.DriverName) {
		return nil, fmt.Errorf("driver name %q: want a domain name of at most 63 characters", cfg.DriverName)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 30 * time.Second
	}
	return &Controller{cfg: cfg, log: cfg.Logger}, nil
}

// Server returns a gRPC server with the Identity and Controller services
// registered and berth's logging interceptor (requests logged with their
// secrets stripped, errors mapped by Code) installed.
func (c *Controller) Server(opts ...grpc.ServerOption) *grpc.Server {
	ics := append([]grpc.UnaryServerInterceptor{logInterceptor(c.log)}, c.cfg.Interceptors...)
	opts = append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(ics...)}, opts...)
	s := grpc.NewServer(opts...)
	csi.RegisterIdentityServer(s, &controllerIdentity{c: c})
	csi.RegisterControllerServer(s, &controllerServer{})
	return s
}

// Serve answers CSI calls on lis until ctx ends, then waits up to
// ShutdownTimeout for the calls in flight.
func (c *Controller) Serve(ctx context.Context, lis net.Listener) error {
	s := c.Server()
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(lis) }()
	c.ready.Store(true)
	c.log.Info("serving", slog.String("endpoint", lis.Addr().String()), slog.String("driver", c.cfg.DriverName), slog.String("version", c.cfg.Version), slog.String("service", "controller"))
	select {
	case err := <-errc:
		c.ready.Store(false)
		return fmt.Errorf("serve gRPC: %w", err)
	case <-ctx.Done():
	}
	c.ready.Store(false)
	sctx, cancel := context.WithTimeout(context.Background(), c.cfg.ShutdownTimeout)
	defer cancel()
	c.log.Info("stopping: waiting for calls in flight", slog.Duration("timeout", c.cfg.ShutdownTimeout))
	stopGRPC(sctx, c.log, s)
	if err := <-errc; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve gRPC: %w", err)
	}
	c.log.Info("stopped")
	return nil
}

// controllerIdentity is berth controller's Identity service: the same
// driver name as the node plugin's, and the Controller service.
type controllerIdentity struct {
	csi.UnimplementedIdentityServer
	c *Controller
}

var _ csi.IdentityServer = (*controllerIdentity)(nil)

func (s *controllerIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.c.cfg.DriverName, VendorVersion: s.c.cfg.Version}, nil
}

func (s *controllerIdentity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{
			Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE},
		},
	}}}, nil
}

// Probe is ready while Serve accepts calls: the controller depends on
// nothing else.
func (s *controllerIdentity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(s.c.ready.Load())}, nil
}

// controllerServer implements ControllerPublishVolume and
// ControllerUnpublishVolume; every other Controller call answers
// Unimplemented (the embedded server).
type controllerServer struct {
	csi.UnimplementedControllerServer
}

var _ csi.ControllerServer = (*controllerServer)(nil)

func (*controllerServer) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: []*csi.ControllerServiceCapability{{
		Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME},
		},
	}}}, nil
}

// ControllerPublishVolume checks the request and answers with the node it
// publishes to (PublishContextNode). It touches no storage: the node
// attaches at stage. It does not refuse a single-node volume already
// published elsewhere, since it keeps no record of publishes: the CO's
// attach-detach controller does (the Multi-Attach check), and the node's
// reservation fences what slips through.
func (*controllerServer) ControllerPublishVolume(_ context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if err := validatePublish(req); err != nil {
		return nil, toStatus(err, req.GetSecrets())
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{PublishContextNode: req.GetNodeId()}}, nil
}

// ControllerUnpublishVolume succeeds for any well-formed request: there is
// nothing to undo on the controller's side, and a volume never published
// is unpublished already. An empty node_id (unpublish from every node) is
// allowed by the spec.
func (*controllerServer) ControllerUnpublishVolume(_ context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, toStatus(err, req.GetSecrets())
	}
	if req.GetNodeId() != "" {
		if err := validateNodeID(req.GetNodeId()); err != nil {
			return nil, toStatus(err, req.GetSecrets())
		}
	}
	if err := validateSecrets(req.GetSecrets()); err != nil {
		return nil, toStatus(err, req.GetSecrets())
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// validatePublish checks a ControllerPublishVolume request as the stage
// will: the volume ID, the node ID, the capability (berth's filesystems
// and mount options, whichever node stages it) and the sizes of the
// contexts and secrets.
func validatePublish(req *csi.ControllerPublishVolumeRequest) error {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return err
	}
	if err := validateNodeID(req.GetNodeId()); err != nil {
		return err
	}
	if _, err := validateCapability(req.GetVolumeCapability(), fs.SupportedFsTypes(), fs.ParseMountOptions); err != nil {
		return err
	}
	if err := validateContext("volume_context", req.GetVolumeContext()); err != nil {
		return err
	}
	return validateSecrets(req.GetSecrets())
}

// maxNodeIDLen is the CSI size limit of a node_id.
const maxNodeIDLen = 256

// validateNodeID checks a node_id from the CO.
func validateNodeID(id string) error {
	switch {
	case id == "":
		return errdefs.InvalidArgument("node_id: missing")
	case len(id) > maxNodeIDLen:
		return errdefs.InvalidArgument("node_id: %d bytes, the CSI limit is %d", len(id), maxNodeIDLen)
	case hasControl(id):
		return errdefs.InvalidArgument("node_id %q: contains control characters", id)
	}
	return nil
}
