package kubeapi

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// TaintOutOfService is the taint an operator puts on a node that is shut
// down for good (KEP-2268): Kubernetes then force-detaches its volumes,
// and berth may fence it.
const TaintOutOfService = "node.kubernetes.io/out-of-service"

// Config is what a Takeover asks with.
type Config struct {
	// DriverName is the CSI driver name, part of every VolumeAttachment's
	// name.
	DriverName string
	// NodeName is this node's name: berth's node ID, which is the
	// kubelet's node name.
	NodeName string
	// NodeKey is the reservation key berth derives from a node ID: the
	// holder's node is the Node whose name has the holder's key.
	NodeKey func(nodeID string) uint64
	// Timeout bounds one decision (all its requests); default 10s.
	Timeout time.Duration
	// TokenFile and CAFile default to the service account's files.
	TokenFile, CAFile string
}

// Takeover decides, from the Kubernetes API at the moment it is asked,
// whether the CO has moved a volume from the node that holds its
// reservation to this one.
type Takeover struct {
	cfg   Config
	api   *client
	names nodeNames
}

// NewInCluster is a Takeover that asks the API server of the pod's
// environment (KUBERNETES_SERVICE_HOST, KUBERNETES_SERVICE_PORT).
func NewInCluster(cfg Config) (*Takeover, error) {
	if cfg.TokenFile == "" {
		cfg.TokenFile = DefaultTokenFile
	}
	if cfg.CAFile == "" {
		cfg.CAFile = DefaultCAFile
	}
	api, err := newClient(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"), cfg.TokenFile, cfg.CAFile)
	if err != nil {
		return nil, err
	}
	return newTakeover(cfg, api)
}

func newTakeover(cfg Config, api *client) (*Takeover, error) {
	switch {
	case cfg.DriverName == "":
		return nil, fmt.Errorf("kubernetes takeover: no driver name")
	case cfg.NodeName == "":
		return nil, fmt.Errorf("kubernetes takeover: no node name")
	case cfg.NodeKey == nil:
		return nil, fmt.Errorf("kubernetes takeover: no node key function")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	return &Takeover{cfg: cfg, api: api}, nil
}

// AttachmentName is the name Kubernetes gives the VolumeAttachment of a
// CSI volume on a node: "csi-" and the hex SHA-256 of the volume handle,
// the driver name and the node name, concatenated (getAttachmentName in
// kubernetes pkg/volume/csi/csi_attacher.go, v1.34).
func AttachmentName(volumeHandle, driverName, nodeName string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(volumeHandle+driverName+nodeName)))
}

// Decision is a Takeover's answer.
type Decision struct {
	// Allowed: the API shows the volume given to this node and taken
	// from the holder.
	Allowed bool
	// HolderNode is the holder's node name where one Node has its key
	// (for a refusal, possibly from a Node list up to a minute old).
	HolderNode string
	// Reason says what the API showed, or what was missing.
	Reason string
}

// Authorize says whether this node may preempt the node whose key holder
// holds volumeID's reservation. It allows that only on fresh evidence, read
// from the API server now (quorum reads, no cache):
//
//   - this node's VolumeAttachment for the volume exists, is not being
//     deleted and is attached: the attach-detach controller gave the
//     volume to this node, which for a single-node volume it does only
//     once no other node has it attached (its Multi-Attach check);
//   - and the holder's node has no VolumeAttachment for the volume, or
//     carries the out-of-service taint, or no Node has the holder's key
//     any more (its Node object is deleted) and no VolumeAttachment of
//     the volume's PersistentVolume names a node other than this one.
//
// Everything else refuses, and says why: an API error, a token that
// cannot be read or is refused, a VolumeAttachment still there. A node
// whose kubelet retries the stage of a pod that was deleted (a partitioned
// node come back) has no VolumeAttachment any more, so it is never
// allowed to take the volume back. Authorize fails closed and returns no
// error: every failure is a refusal with its reason.
func (t *Takeover) Authorize(ctx context.Context, volumeID string, holder uint64) Decision {
	ctx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	defer cancel()
	if holder == t.cfg.NodeKey(t.cfg.NodeName) {
		return Decision{Reason: fmt.Sprintf("the holder's key %#016x is this node's own", holder)}
	}
	d := t.authorize(ctx, volumeID, holder)
	if d.HolderNode == "" {
		d.HolderNode = t.holderName(ctx, holder)
	}
	return d
}

// authorize is Authorize for a holder that is not this node.
func (t *Takeover) authorize(ctx context.Context, volumeID string, holder uint64) Decision {
	own := AttachmentName(volumeID, t.cfg.DriverName, t.cfg.NodeName)
	va, err := t.api.getVolumeAttachment(ctx, own)
	switch {
	case errors.Is(err, errNotFound):
		return Decision{Reason: fmt.Sprintf("no VolumeAttachment %s gives the volume to this node %s (the CO has not moved it here, or the pod it was staged for is gone); the holder is key %#016x", own, t.cfg.NodeName, holder)}
	case err != nil:
		return Decision{Reason: fmt.Sprintf("cannot read this node's VolumeAttachment %s, so no evidence the volume was moved from the holder (key %#016x): %v", own, holder, err)}
	}
	if why := notAttachedHere(va, t.cfg.DriverName, t.cfg.NodeName); why != "" {
		return Decision{Reason: fmt.Sprintf("VolumeAttachment %s %s; the holder is key %#016x", own, why, holder)}
	}

	nodes, err := t.api.listNodes(ctx)
	if err != nil {
		return Decision{Reason: fmt.Sprintf("cannot list the nodes to find the holder of key %#016x: %v", holder, err)}
	}
	t.storeNodeNames(nodes)
	var holders []node
	for _, n := range nodes {
		if n.Metadata.Name != "" && t.cfg.NodeKey(n.Metadata.Name) == holder {
			holders = append(holders, n)
		}
	}
	switch len(holders) {
	case 0:
		return t.holderGone(ctx, va, holder)
	case 1:
	default:
		names := make([]string, len(holders))
		for i, n := range holders {
			names[i] = n.Metadata.Name
		}
		return Decision{Reason: fmt.Sprintf("the holder's key %#016x is the key of several nodes (%s): cannot tell which holds the volume", holder, strings.Join(names, ", "))}
	}
	h := holders[0]
	name := h.Metadata.Name
	for _, taint := range h.Spec.Taints {
		if taint.Key == TaintOutOfService {
			return Decision{Allowed: true, HolderNode: name, Reason: fmt.Sprintf("VolumeAttachment %s attaches the volume to this node, and the holder %s is tainted %s", own, name, TaintOutOfService)}
		}
	}
	theirs := AttachmentName(volumeID, t.cfg.DriverName, name)
	hva, err := t.api.getVolumeAttachment(ctx, theirs)
	switch {
	case errors.Is(err, errNotFound):
		return Decision{Allowed: true, HolderNode: name, Reason: fmt.Sprintf("VolumeAttachment %s attaches the volume to this node, and none attaches it to the holder %s", own, name)}
	case err != nil:
		return Decision{HolderNode: name, Reason: fmt.Sprintf("cannot read the holder %s's VolumeAttachment %s: %v", name, theirs, err)}
	}
	state := "attached"
	switch {
	case hva.Metadata.DeletionTimestamp != nil:
		state = "being detached"
	case !hva.Status.Attached:
		state = "not attached yet"
	}
	return Decision{HolderNode: name, Reason: fmt.Sprintf("the holder %s still has VolumeAttachment %s (%s), is not tainted %s and its Node exists", name, theirs, state, TaintOutOfService)}
}

// holderGone decides when no Node has the holder's key: its Node object
// was deleted, or the holder's berth runs under another node ID than its
// Node's name (a misconfigured --node-id). The second must not pass for
// the first, so the takeover is allowed only when no VolumeAttachment of
// the volume's PersistentVolume names another node: a deleted node's are
// deleted with it.
func (t *Takeover) holderGone(ctx context.Context, own *volumeAttachment, holder uint64) Decision {
	pv := own.Spec.Source.PersistentVolumeName
	if pv == "" {
		return Decision{Reason: fmt.Sprintf("no Node has the holder's key %#016x, and VolumeAttachment %s names no PersistentVolume, so its other attachments cannot be looked for", holder, own.Metadata.Name)}
	}
	vas, err := t.api.listVolumeAttachments(ctx)
	if err != nil {
		return Decision{Reason: fmt.Sprintf("no Node has the holder's key %#016x, and the VolumeAttachments cannot be listed to see that no other node has the volume: %v", holder, err)}
	}
	for _, va := range vas {
		if va.Spec.Source.PersistentVolumeName == pv && va.Spec.Attacher == t.cfg.DriverName && va.Spec.NodeName != t.cfg.NodeName {
			return Decision{Reason: fmt.Sprintf("no Node has the holder's key %#016x, but VolumeAttachment %s still gives %s to node %s (is the holder's berth --node-id its Node's name?)", holder, va.Metadata.Name, pv, va.Spec.NodeName)}
		}
	}
	return Decision{Allowed: true, Reason: fmt.Sprintf("VolumeAttachment %s attaches the volume to this node, no Node has the holder's key %#016x (its Node object is deleted), and no VolumeAttachment of %s names another node", own.Metadata.Name, holder, pv)}
}

// notAttachedHere says why a VolumeAttachment is no evidence that the
// volume is attached to node by driver, or "" when it is.
func notAttachedHere(va *volumeAttachment, driver, node string) string {
	switch {
	case va.Spec.Attacher != driver:
		return fmt.Sprintf("is the attacher %q's, not %q's", va.Spec.Attacher, driver)
	case va.Spec.NodeName != node:
		return fmt.Sprintf("is for node %q, not this node %q", va.Spec.NodeName, node)
	case va.Metadata.DeletionTimestamp != nil:
		return "is being deleted (the volume is being detached from this node)"
	case !va.Status.Attached:
		return "is not attached yet"
	}
	return ""
}
