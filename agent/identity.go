package agent

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// identityServer implements the CSI Identity service.
type identityServer struct {
	csi.UnimplementedIdentityServer
	a *Agent
}

var _ csi.IdentityServer = (*identityServer)(nil)

func (s *identityServer) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{
		Name:          s.a.cfg.DriverName,
		VendorVersion: s.a.cfg.Version,
	}, nil
}

// GetPluginCapabilities: berth serve is a node plugin only (no Controller
// service: berth controller serves that, see Controller). Volumes grow while mounted (ONLINE expansion), and when the
// node has a topology the CO must honour it.
func (s *identityServer) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	caps := []*csi.PluginCapability{{
		Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE},
		},
	}}
	if len(s.a.cfg.Topology) > 0 {
		caps = append(caps, &csi.PluginCapability{
			Type: &csi.PluginCapability_Service_{
				Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS},
			},
		})
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe answers ready=false until state is loaded and the server runs,
// then asks Config.ReadyFunc (the node's own checks).
func (s *identityServer) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if !s.a.ready.Load() {
		return &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
	}
	if f := s.a.cfg.ReadyFunc; f != nil {
		if err := f(ctx); err != nil {
			return nil, status.Error(codes.FailedPrecondition, "node is not healthy: "+err.Error())
		}
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
