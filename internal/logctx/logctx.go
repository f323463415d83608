// Package logctx carries a request's logger through a context, so that
// every package logs a volume's lines with the same attributes and one
// volume's whole life can be read back with one filter
// (journalctl VOLUME_ID=..., or the JSON logs' volume_id).
//
// The attribute keys berth uses, in every package:
//
//	volume_id            the CSI volume ID (set by the agent for each RPC)
//	staging_target_path  the CSI staging path of the request
//	target_path          the CSI target path of the request
//	volume_path          the CSI volume path of the request
//	method               the gRPC method
//	node_id              a CSI node ID: this node's, or the node a
//	                     ControllerPublishVolume names
//	target               the transport's name of the storage: iqn/lun,
//	                     nqn/namespace, or the file's path
//	portal, path         one way to the target (iSCSI portal, NVMe address)
//	controller, session  the kernel's NVMe controller or iSCSI session
//	device               a block device path
//	error                the error of a failed step
//	duration             how long a step took, in seconds
//	bytes                bytes a trim reported trimmed
//	reason               why a step was skipped
package logctx

import (
	"context"
	"log/slog"
)

type key struct{}

// With returns a context that carries l.
func With(ctx context.Context, l *slog.Logger) context.Context {
	return context.WithValue(ctx, key{}, l)
}

// From returns the logger ctx carries, or fallback.
func From(ctx context.Context, fallback *slog.Logger) *slog.Logger {
	if l, ok := ctx.Value(key{}).(*slog.Logger); ok {
		return l
	}
	return fallback
}
