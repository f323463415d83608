package agent

import "context"

// A TakeoverAuthority says whether a volume that another node still holds
// at the target (its reservation key holds the volume's persistent
// reservation) has been given to this node, so that NodeStageVolume may
// preempt that node and fence it off the storage. Without its word the
// stage fails closed and names the holder. It is asked only on that path:
// a stage that finds no other node's reservation never asks.
type TakeoverAuthority interface {
	AuthorizeTakeover(ctx context.Context, req TakeoverRequest) (TakeoverDecision, error)
}

// TakeoverRequest is what a TakeoverAuthority decides on.
type TakeoverRequest struct {
	// VolumeID is the CSI volume ID of the stage.
	VolumeID string
	// NodeID is this node's ID (NodeGetInfo's node_id).
	NodeID string
	// Holder is the reservation key that holds the volume now: another
	// node's berth key.
	Holder uint64
	// PublishContext is the stage's publish_context, as the CO sent it.
	PublishContext map[string]string
}

// TakeoverDecision is a TakeoverAuthority's answer.
type TakeoverDecision struct {
	// Allowed: the volume has moved to this node; the stage may preempt
	// the holder.
	Allowed bool
	// HolderNode is the holder's node ID where the authority knows it
	// (it derived the holder's key from a node it found), or "".
	HolderNode string
	// Reason says why, in words for the log and for the refusal
	// ("VolumeAttachment csi-… attaches it to this node and none to
	// node-a", "node-a still has it attached").
	Reason string
}
