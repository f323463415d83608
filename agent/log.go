package agent

import (
	"context"
	"log/slog"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/berth-csi/berth/internal/failpoint"
	"github.com/berth-csi/berth/internal/logctx"
)

const strippedValue = "***stripped***"

// stripSecrets returns a copy of msg in which every secret field is
// replaced: fields named "secrets" and fields the CSI spec marks with the
// csi_secret option. Map fields keep their keys (so an operator sees which
// secrets were sent) but every value becomes strippedValue; string fields
// become strippedValue; other kinds are cleared. Nested messages, lists
// and maps of messages are walked.
func stripSecrets(msg proto.Message) proto.Message {
	if msg == nil {
		return nil
	}
	c := proto.Clone(msg)
	stripMessage(c.ProtoReflect())
	return c
}

func isSecretField(fd protoreflect.FieldDescriptor) bool {
	if fd.Name() == "secrets" {
		return true
	}
	opts, ok := fd.Options().(*descriptorpb.FieldOptions)
	if !ok || opts == nil {
		return false
	}
	v, ok := proto.GetExtension(opts, csi.E_CsiSecret).(bool)
	return ok && v
}

func stripMessage(m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if isSecretField(fd) {
			switch {
			case fd.IsMap():
				mp := m.Mutable(fd).Map()
				var keys []protoreflect.MapKey
				mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
					keys = append(keys, k)
					return true
				})
				for _, k := range keys {
					if fd.MapValue().Kind() == protoreflect.StringKind {
						mp.Set(k, protoreflect.ValueOfString(strippedValue))
					} else {
						mp.Clear(k)
					}
				}
			case fd.Kind() == protoreflect.StringKind && !fd.IsList():
				m.Set(fd, protoreflect.ValueOfString(strippedValue))
			default:
				m.Clear(fd)
			}
			return true
		}
		switch {
		case fd.IsMap():
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					stripMessage(mv.Message())
					return true
				})
			}
		case fd.IsList():
			if fd.Kind() == protoreflect.MessageKind {
				l := v.List()
				for i := 0; i < l.Len(); i++ {
					stripMessage(l.Get(i).Message())
				}
			}
		case fd.Kind() == protoreflect.MessageKind:
			stripMessage(v.Message())
		}
		return true
	})
}

// requestAttrs extracts the structured log keys of a CSI request. Only
// named, non-secret fields are picked.
func requestAttrs(req any) []any {
	var attrs []any
	type (
		volumeIDer    interface{ GetVolumeId() string }
		stagingPather interface{ GetStagingTargetPath() string }
		targetPather  interface{ GetTargetPath() string }
		volumePather  interface{ GetVolumePath() string }
		nodeIDer      interface{ GetNodeId() string }
	)
	if r, ok := req.(volumeIDer); ok && r.GetVolumeId() != "" {
		attrs = append(attrs, slog.String("volume_id", r.GetVolumeId()))
	}
	if r, ok := req.(stagingPather); ok && r.GetStagingTargetPath() != "" {
		attrs = append(attrs, slog.String("staging_target_path", r.GetStagingTargetPath()))
	}
	if r, ok := req.(targetPather); ok && r.GetTargetPath() != "" {
		attrs = append(attrs, slog.String("target_path", r.GetTargetPath()))
	}
	if r, ok := req.(volumePather); ok && r.GetVolumePath() != "" {
		attrs = append(attrs, slog.String("volume_path", r.GetVolumePath()))
	}
	if r, ok := req.(nodeIDer); ok && r.GetNodeId() != "" {
		attrs = append(attrs, slog.String("node_id", r.GetNodeId()))
	}
	return attrs
}

// withLogger stores a request-scoped logger in ctx, where the transports
// find it too.
func withLogger(ctx context.Context, l *slog.Logger) context.Context {
	return logctx.With(ctx, l)
}

// logFrom returns the request-scoped logger, or fallback.
func logFrom(ctx context.Context, fallback *slog.Logger) *slog.Logger {
	return logctx.From(ctx, fallback)
}

// maxLoggedRequest is the largest request logged whole at debug level:
// well above any valid request's volume and publish contexts, well below
// the gRPC message limit.
const maxLoggedRequest = 32 << 10

// logInterceptor logs every RPC once it finished: method, the request's
// volume and path keys, code, duration. The whole request, secrets
// stripped, is logged at debug level when it arrives.
func logInterceptor(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		attrs := requestAttrs(req)
		l := log.With(slog.String("method", info.FullMethod))
		l = l.With(attrs...)
		if l.Enabled(ctx, slog.LevelDebug) {
			if m, ok := req.(proto.Message); ok {
				if n := proto.Size(m); n > maxLoggedRequest {
					// The handler refuses what is over the request limits;
					// the log line must not cost more than the refusal.
					l.DebugContext(ctx, "request", slog.Int("request_bytes", n), slog.String("request", "not logged: over the logged size"))
				} else {
					l.DebugContext(ctx, "request", slog.String("request", protojson.Format(stripSecrets(m))))
				}
			}
		}
		start := time.Now()
		resp, err := handler(withLogger(ctx, l), req)
		d := time.Since(start)
		code := Code(err)
		switch code {
		case codes.OK:
			// Calls about no volume (Probe, GetCapabilities, GetInfo)
			// come every few seconds; they are logged at debug level.
			lvl := slog.LevelInfo
			if len(attrs) == 0 {
				lvl = slog.LevelDebug
			}
			l.Log(ctx, lvl, "done", slog.Duration("duration", d))
		case codes.Internal, codes.Unknown, codes.DataLoss:
			l.ErrorContext(ctx, "failed", slog.String("code", code.String()), slog.String("error", errorMessage(err)), slog.Duration("duration", d))
		default:
			l.WarnContext(ctx, "refused", slog.String("code", code.String()), slog.String("error", errorMessage(err)), slog.Duration("duration", d))
		}
		return resp, err
	}
}

func errorMessage(err error) string {
	if err == nil {
		return ""
	}
	return status.Convert(err).Message()
}

// stepTimer records how long each step of an RPC took, for the log line
// that reports the RPC's result.
type stepTimer struct {
	start, last time.Time
	steps       []any
}

func newStepTimer() *stepTimer {
	now := time.Now()
	return &stepTimer{start: now, last: now}
}

// mark ends the step called name.
func (s *stepTimer) mark(name string) {
	failpoint.Hit("step." + name)
	now := time.Now()
	s.steps = append(s.steps, slog.Duration(name, now.Sub(s.last)))
	s.last = now
}

// attr is the "took" group: every marked step and the total.
func (s *stepTimer) attr() slog.Attr {
	steps := append(s.steps, slog.Duration("total", s.last.Sub(s.start)))
	return slog.Group("took", steps...)
}
