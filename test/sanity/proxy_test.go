package sanity

import (
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// csi-sanity decides whether to run its node lifecycle specs ("should
// work", "should be idempotent") from the CONTROLLER_SERVICE capability
// of the *node* endpoint. berth is a node plugin and rightly does not
// claim it, so sanity talks to berth through this proxy: every call is
// forwarded to berth as raw bytes and berth's answer comes back
// unchanged, except that GetPluginCapabilities also lists the controller
// service that fileController provides on its own socket.

// rawFrame is an undecoded gRPC message.
type rawFrame struct{ b []byte }

// rawCodec passes messages through without decoding them.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	f, ok := v.(*rawFrame)
	if !ok {
		return nil, fmt.Errorf("raw codec: cannot marshal %T", v)
	}
	return f.b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	f, ok := v.(*rawFrame)
	if !ok {
		return fmt.Errorf("raw codec: cannot unmarshal into %T", v)
	}
	f.b = append([]byte(nil), data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

const pluginCapabilitiesMethod = "/csi.v1.Identity/GetPluginCapabilities"

// newProxy returns a gRPC server that forwards every unary call to conn.
func newProxy(conn *grpc.ClientConn) *grpc.Server {
	return grpc.NewServer(
		grpc.ForceServerCodec(rawCodec{}),
		grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
			method, ok := grpc.MethodFromServerStream(stream)
			if !ok {
				return fmt.Errorf("proxy: no method name")
			}
			var in, out rawFrame
			if err := stream.RecvMsg(&in); err != nil {
				return err
			}
			if err := conn.Invoke(stream.Context(), method, &in, &out, grpc.ForceCodec(rawCodec{})); err != nil {
				return err // berth's status, code and message unchanged
			}
			if method == pluginCapabilitiesMethod {
				b, err := addControllerService(out.b)
				if err != nil {
					return err
				}
				out.b = b
			}
			return stream.SendMsg(&out)
		}),
	)
}

func addControllerService(b []byte) ([]byte, error) {
	var resp csi.GetPluginCapabilitiesResponse
	if err := proto.Unmarshal(b, &resp); err != nil {
		return nil, err
	}
	for _, c := range resp.Capabilities {
		if c.GetService().GetType() == csi.PluginCapability_Service_CONTROLLER_SERVICE {
			return nil, fmt.Errorf("berth claims a controller service: %v", &resp)
		}
	}
	resp.Capabilities = append(resp.Capabilities, controllerServiceCap())
	return proto.Marshal(&resp)
}
