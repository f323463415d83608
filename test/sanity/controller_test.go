package sanity

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// fileController is the smallest CSI Controller that makes csi-sanity
// drive berth's node lifecycle: volumes are sparse image files in the
// file root that berth's file transport attaches as loop devices.
type fileController struct {
	csi.UnimplementedControllerServer
	csi.UnimplementedIdentityServer
	root string

	mu   sync.Mutex
	vols map[string]int64 // volume ID -> size
}

const (
	driverName = "berth.csi.io"
	minSize    = 64 << 20
)

func newFileController(root string) *fileController {
	return &fileController{root: root, vols: make(map[string]int64)}
}

func (c *fileController) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: driverName, VendorVersion: "sanity"}, nil
}

func (c *fileController) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{controllerServiceCap()}}, nil
}

func controllerServiceCap() *csi.PluginCapability {
	return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{
		Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE},
	}}
}

func (c *fileController) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (c *fileController) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t},
		}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// volumeID derives a file-name-safe ID from the CO's volume name.
func volumeID(name string) string {
	sum := sha256.Sum256([]byte(name))
	return "sanity-" + hex.EncodeToString(sum[:12])
}

func (c *fileController) image(id string) string { return filepath.Join(c.root, id+".img") }

// checkCreate validates a CreateVolumeRequest for the test controllers
// and returns the volume ID and size it asks for.
func checkCreate(req *csi.CreateVolumeRequest) (id string, size int64, err error) {
	if req.GetName() == "" {
		return "", 0, status.Error(codes.InvalidArgument, "name: missing")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return "", 0, status.Error(codes.InvalidArgument, "volume_capabilities: missing")
	}
	size = max(req.GetCapacityRange().GetRequiredBytes(), minSize)
	if l := req.GetCapacityRange().GetLimitBytes(); l > 0 && size > l {
		return "", 0, status.Error(codes.OutOfRange, "capacity_range: limit below the minimum size")
	}
	return volumeID(req.GetName()), size, nil
}

func (c *fileController) CreateVolume(_ context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	id, size, err := checkCreate(req)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if have, ok := c.vols[id]; ok && have != size {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s exists with %d bytes", req.GetName(), have)
	}
	f, err := os.OpenFile(c.image(id), os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	c.vols[id] = size
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:      id,
		CapacityBytes: size,
		VolumeContext: map[string]string{"file": id + ".img"},
	}}, nil
}

func (c *fileController) DeleteVolume(_ context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id: missing")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.vols[req.GetVolumeId()]; !ok {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if err := os.Remove(c.image(req.GetVolumeId())); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	delete(c.vols, req.GetVolumeId())
	return &csi.DeleteVolumeResponse{}, nil
}

func (c *fileController) ControllerExpandVolume(_ context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id: missing")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	have, ok := c.vols[req.GetVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s", req.GetVolumeId())
	}
	size := max(req.GetCapacityRange().GetRequiredBytes(), have)
	if err := os.Truncate(c.image(req.GetVolumeId()), size); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	c.vols[req.GetVolumeId()] = size
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: true}, nil
}

func (c *fileController) ValidateVolumeCapabilities(_ context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	c.mu.Lock()
	_, ok := c.vols[req.GetVolumeId()]
	c.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s", req.GetVolumeId())
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeCapabilities: req.GetVolumeCapabilities(),
	}}, nil
}
