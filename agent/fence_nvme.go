package agent

import (
	"context"

	"github.com/berth-csi/berth/devices"
)

// reclaimZeroKey gives this node's key back to a host that the target
// lists as a registrant with key 0 (NVMe, which tells registrants apart
// by host ID): left so by an IOC_PR_REGISTER to key 0, which on NVMe
// replaces the key instead of unregistering. Such a registrant writes
// under a registrants-only reservation and no REGISTER without
// PR_FL_IGNORE_KEY changes it (the kernel sends Register for old key 0,
// which conflicts, and Replace checks the current key): Replace with
// IEKEY and a non-zero old key does. It returns the reservation as it is
// then; a host not in that state gets res back unchanged.
func (n *nodeServer) reclaimZeroKey(ctx context.Context, s *stageRun, f prDevice, mode string, key uint64, res devices.Reservation) (devices.Reservation, error) {
	if !res.OwnKnown || !res.OwnRegistered || res.OwnKey != 0 {
		return res, nil
	}
	if err := n.recordFence(s, mode, key); err != nil {
		return res, err
	}
	if err := f.Register(key, key, true); err != nil {
		return res, n.fenceError(s, err)
	}
	s.registered = true
	s.log.WarnContext(ctx, "this host was registered at the target with key 0 (a registrant that writes): its registration now has the node's key")
	r, err := f.ReadReservation()
	if err != nil {
		return res, n.fenceError(s, err)
	}
	return r, nil
}
