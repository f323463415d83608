package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
)

// OperatorTakeover is an operator's one-shot authorisation for a stage on
// this node to take a volume over from the node (or key) that holds it:
// what `berth takeover` writes under the state directory, for installs
// without a cluster that can say where a volume belongs (csc, systemd).
type OperatorTakeover struct {
	VolumeID string `json:"volumeID"`
	// FromNode or FromKey names the holder the operator means: a stage
	// that finds another holder is not authorised.
	FromNode string    `json:"fromNode,omitempty"`
	FromKey  uint64    `json:"fromKey,omitempty"`
	Expires  time.Time `json:"expires"`
}

// takeoverDir is where the operator's authorisations are kept.
func takeoverDir(stateDir string) string { return filepath.Join(stateDir, "takeover") }

// WriteOperatorTakeover records t for the next stage of t.VolumeID on
// the node whose state directory is stateDir, replacing an earlier one
// for that volume.
func WriteOperatorTakeover(stateDir string, t OperatorTakeover) error {
	if err := validateVolumeID(t.VolumeID); err != nil {
		return err
	}
	switch {
	case (t.FromNode == "") == (t.FromKey == 0):
		return errdefs.InvalidArgument("name the holder by its node ID or by its key, one of them")
	case t.FromKey != 0 && !IsBerthKey(t.FromKey):
		return errdefs.InvalidArgument("key %#016x is not a berth key (0xb3e7…): berth never preempts keys it did not make", t.FromKey)
	case len(t.FromNode) > 256 || hasControl(t.FromNode):
		return errdefs.InvalidArgument("node ID %q: want 1 to 256 printable bytes", t.FromNode)
	case !t.Expires.After(time.Now()):
		return errdefs.InvalidArgument("expiry %s: in the past", t.Expires.Format(time.RFC3339))
	}
	dir := takeoverDir(stateDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	b, err := json.Marshal(t)
	if err != nil {
		return err
	}
	return writeFileAtomic(dir, stateFileName(t.VolumeID), b)
}

// operatorAuthority is the TakeoverAuthority of OperatorTakeover
// records: a record that names the volume and its holder, and has not
// expired, allows one takeover and is consumed by it.
type operatorAuthority struct {
	dir string
	now func() time.Time
}

// NewOperatorAuthority is the TakeoverAuthority of `berth takeover` on
// the node whose state directory is stateDir.
func NewOperatorAuthority(stateDir string) TakeoverAuthority {
	return &operatorAuthority{dir: takeoverDir(stateDir), now: time.Now}
}

func (o *operatorAuthority) AuthorizeTakeover(_ context.Context, req TakeoverRequest) (TakeoverDecision, error) {
	p := filepath.Join(o.dir, stateFileName(req.VolumeID))
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return TakeoverDecision{Reason: "no operator authorisation (berth takeover) for it on this node"}, nil
	}
	if err != nil {
		return TakeoverDecision{}, fmt.Errorf("read the operator's takeover: %w", err)
	}
	var t OperatorTakeover
	if err := json.Unmarshal(b, &t); err != nil || t.VolumeID != req.VolumeID {
		return TakeoverDecision{}, fmt.Errorf("the operator's takeover %s: not a takeover of volume %q", p, req.VolumeID)
	}
	key := t.FromKey
	if t.FromNode != "" {
		key = NodeKey(t.FromNode)
	}
	if !o.now().Before(t.Expires) {
		os.Remove(p)
		d := TakeoverDecision{Reason: fmt.Sprintf("the operator's takeover expired at %s", t.Expires.Format(time.RFC3339))}
		if key == req.Holder {
			d.HolderNode = t.FromNode
		}
		return d, nil
	}
	if key != req.Holder {
		return TakeoverDecision{Reason: fmt.Sprintf("the operator's takeover names %s, not the holder", describeKey(key, t.FromNode))}, nil
	}
	// Consumed before the preempt: a stage that fails after needs a new
	// one, and no later stage takes the volume over on this one.
	if err := os.Remove(p); err != nil {
		return TakeoverDecision{}, fmt.Errorf("consume the operator's takeover: %w", err)
	}
	return TakeoverDecision{Allowed: true, HolderNode: t.FromNode, Reason: fmt.Sprintf("an operator authorised it (berth takeover, valid until %s)", t.Expires.Format(time.RFC3339))}, nil
}
