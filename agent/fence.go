package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Fencing: one writer per volume, enforced by the target. A stage of a
// single-node volume over iSCSI or NVMe takes the device's persistent
// reservation (Write Exclusive – Registrants Only) with the node's key
// (NodeKey) before anything reads or writes the device, and the unstage
// gives it back. Another node's stage finds it and refuses, unless a
// TakeoverAuthority says the volume has moved: then it preempts the
// holder and aborts its queued commands, and the old node's writes fail
// at the target from then on. README.md's "Fencing" section is the
// operator's view.

// ContextFencing is the volume_context key that opts a volume out of
// fencing ("none") or asks for the default ("reservation").
const ContextFencing = "fencing"

// The fencing modes of a volume (fenceRecord.Mode).
const (
	// fenceReserve: the node's key is registered on every path and
	// holds a Write Exclusive – Registrants Only reservation.
	fenceReserve = "reservation"
	// fenceRegister: the node's key is registered on every path, no
	// reservation (MULTI_NODE_MULTI_WRITER, MULTI_NODE_SINGLE_WRITER:
	// every node writes or the CO picks the one writer).
	fenceRegister = "registrant"
	// fenceNone: volume_context fencing "none": staged unfenced, and
	// reported so.
	fenceNone = "none"
	// fenceUnavailable: the device's target has no reservations at all
	// (an NVMe controller without them, devices.ReservationReadable):
	// staged unfenced, and reported so.
	fenceUnavailable = "unavailable"
)

// fenceType is the reservation berth takes.
const fenceType = devices.PRWriteExclusiveRegOnly

// fenceRecord is a volume's fencing, recorded before the first
// registration so that an unstage after a crash gives back what a stage
// took.
type fenceRecord struct {
	Mode string `json:"mode"`
	// Key is the node's key the stage registered (0 for fenceNone).
	Key uint64 `json:"key,omitempty"`
}

// prHost is the kernel side of fencing (devices.PR); tests replace it.
type prHost interface {
	// open opens d (the whole device: an sd disk, a dm-multipath map,
	// an NVMe head) for reservation commands.
	open(d *devices.Device) (prDevice, error)
	// paths are the devices registrations are made through: d's paths
	// (devices.PRPaths).
	paths(d *devices.Device) ([]*devices.Device, error)
}

// prDevice is an open device's reservation commands (*devices.PR).
type prDevice interface {
	Register(oldKey, newKey uint64, ignoreExisting bool) error
	Reserve(key uint64, t devices.PRType) error
	Release(key uint64, t devices.PRType) error
	Preempt(key, victim uint64, t devices.PRType, abort bool) error
	ReadReservation() (devices.Reservation, error)
	Close() error
}

type kernelPR struct{}

var _ prDevice = (*devices.PR)(nil)

func (kernelPR) open(d *devices.Device) (prDevice, error) {
	p, err := devices.OpenPR(d)
	if err != nil {
		return nil, err // never a typed nil inside the interface
	}
	return p, nil
}

func (kernelPR) paths(d *devices.Device) ([]*devices.Device, error) { return devices.PRPaths(d) }

// parseFencing validates volume_context "fencing".
func parseFencing(vctx map[string]string) (string, error) {
	v, ok := vctx[ContextFencing]
	switch {
	case !ok || v == fenceReserve:
		return fenceReserve, nil
	case v == fenceNone:
		return fenceNone, nil
	}
	return "", errdefs.InvalidArgument("volume_context[%q] %q: want %q (the default) or %q", ContextFencing, v, fenceReserve, fenceNone)
}

// fenceModeOf is the fencing a stage of mode on device d takes, "" for
// none at all (see fenceApplies).
func fenceModeOf(d *devices.Device, mode csi.VolumeCapability_AccessMode_Mode, optOut bool) string {
	m := fenceApplies(d.ID.Kind, mode)
	switch {
	case m == "":
		return ""
	case optOut:
		return fenceNone
	case !devices.ReservationReadable(d):
		return fenceUnavailable
	}
	return m
}

// fenceApplies is the fencing a volume of mode on a device of kind gets
// from a target with reservations: fenceReserve, fenceRegister, or "" for
// none at all: a device that is node-local (a loop device of the file
// transport: no other node reaches it) and reader-only modes (readers
// need no registration under Write Exclusive – Registrants Only).
func fenceApplies(kind string, mode csi.VolumeCapability_AccessMode_Mode) string {
	switch kind {
	case devices.KindSCSI, devices.KindNVMe, devices.KindDM:
	default:
		return ""
	}
	switch mode {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return fenceReserve
	case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER:
		return fenceRegister
	}
	return ""
}

// describeKey names a reservation key for an operator: its node where
// node is known.
func describeKey(k uint64, node string) string {
	switch {
	case node != "":
		return fmt.Sprintf("node %q (key %#016x)", node, k)
	case IsBerthKey(k):
		return fmt.Sprintf("key %#016x (the berth key of an unknown node)", k)
	}
	return fmt.Sprintf("key %#016x (not a berth key: multipathd's, an operator's or another cluster's)", k)
}

// describeHolder is describeKey for a key found at the target: node if
// known, else the node Config.HolderName knows for a berth key.
func (a *Agent) describeHolder(k uint64, node string) string {
	if node == "" && IsBerthKey(k) && a.cfg.HolderName != nil {
		node = a.cfg.HolderName(k)
	}
	return describeKey(k, node)
}

// fenceStage fences the attached device of a stage, before anything
// reads it (probe, fsck, LUKS) or writes it (see the package comment
// above). It records the fence before the first registration.
func (n *nodeServer) fenceStage(ctx context.Context, s *stageRun) error {
	mode := fenceModeOf(s.dev, s.vcap.Mode, s.fencing == fenceNone)
	if mode == "" {
		return nil
	}
	rec := s.rec
	if mode == fenceNone || mode == fenceUnavailable {
		if rec.Fence == nil || rec.Fence.Mode != mode {
			rec.Fence = &fenceRecord{Mode: mode}
			if err := n.a.state.put(rec); err != nil {
				return err
			}
		}
		s.log.WarnContext(ctx, "staged without fencing ("+rec.unfencedReason()+"): another node that stages this volume can write it too")
		return nil
	}
	key := NodeKey(n.a.cfg.NodeID)
	f, err := n.a.pr.open(s.dev)
	if err != nil {
		return fmt.Errorf("volume %q: fence: %w", s.id, err)
	}
	defer f.Close()
	res, err := f.ReadReservation()
	if err != nil {
		return n.fenceError(s, err)
	}
	if res, err = n.reclaimZeroKey(ctx, s, f, mode, key, res); err != nil {
		return err
	}
	foreign := slices.DeleteFunc(append(slices.Clone(res.Keys), res.Holder), func(k uint64) bool { return k == 0 || IsBerthKey(k) })
	if len(foreign) > 0 {
		return errdefs.FailedPrecondition("volume %q: the device %s has persistent-reservation registrations berth did not make: %s; berth touches none of them and does not stage the volume: the operator removes them (sg_persist, nvme resv-register) or stages with volume_context %s: %q",
			s.id, s.dev.Path, describeKey(foreign[0], ""), ContextFencing, fenceNone)
	}
	ours := slices.Contains(res.Keys, key)
	hostHas := res.OwnKnown && res.OwnRegistered && res.OwnKey == key
	others := slices.DeleteFunc(slices.Clone(res.Keys), func(k uint64) bool { return k == key })
	exclusive := res.Holder != 0 && res.Holder != key
	if mode == fenceRegister {
		// Registrants beside an exclusive holder could write: a
		// single-node volume of another node is not joined.
		if exclusive {
			return n.refuseTakeover(ctx, s, f, key, ours, res.Holder, TakeoverDecision{Reason: "its reservation is exclusive and the stage asks for a multi-node mode"})
		}
		if err := n.recordFence(s, mode, key); err != nil {
			return err
		}
		made, _, err := n.registerPaths(s, key, ours, hostHas)
		if err != nil {
			return err
		}
		if ours && len(made) > 0 {
			if err := n.stillHeld(s, f, mode, key, made); err != nil {
				return err
			}
		}
		s.took.mark("fence")
		return nil
	}
	switch {
	case res.Holder == key:
		// Ours already (a repeated stage, a restart): paths that came
		// since get registered; when all of them are new, the
		// reservation is moved onto them (reclaimHolder).
	case res.Holder == 0 && len(others) == 0:
		// Free.
	default:
		// Another node holds it, or is registered and could write:
		// only an authority may give it to this node.
		victim := res.Holder
		if victim == 0 {
			victim = others[0]
		}
		d, err := n.authorizeTakeover(ctx, s, victim)
		if err != nil || !d.Allowed {
			if err != nil {
				d.Reason = err.Error()
			}
			return n.refuseTakeover(ctx, s, f, key, ours, victim, d)
		}
		return n.takeOver(ctx, s, f, key, victim, ours, others, d)
	}
	if err := n.recordFence(s, mode, key); err != nil {
		return err
	}
	made, allNew, err := n.registerPaths(s, key, ours, hostHas)
	if err != nil {
		return err
	}
	if ours && res.Holder == key && len(made) > 0 {
		if err := n.stillHeld(s, f, mode, key, made); err != nil {
			return err
		}
	}
	switch {
	case res.Holder != key:
		if err := f.Reserve(key, fenceType); err != nil {
			if errors.Is(err, devices.ErrReservationConflict) {
				// Another node registered and reserved between the
				// read and the reserve: it won.
				return n.lostRace(ctx, s, f, key)
			}
			return n.fenceError(s, err)
		}
	case allNew && s.dev.ID.Kind != devices.KindNVMe:
		if err := n.reclaimHolder(ctx, s, f, key); err != nil {
			return err
		}
	}
	s.took.mark("fence")
	s.log.InfoContext(ctx, "fenced: the node's key holds the device's reservation", slog.String("key", fmt.Sprintf("%#016x", key)))
	return nil
}

// recordFence records the fence before the first registration.
func (n *nodeServer) recordFence(s *stageRun, mode string, key uint64) error {
	if r := s.rec.Fence; r != nil && r.Mode == mode && r.Key == key {
		return nil
	}
	s.rec.Fence = &fenceRecord{Mode: mode, Key: key}
	return n.a.state.put(s.rec)
}

// registerPaths registers key on every path of the stage's device that
// does not have it, and returns those paths (made) and whether every
// path needed it (allNew). A path registered with another key is refused
// and left as it is: berth replaces no key it did not make. ours: the
// device's keys include key, read before any registration of this call.
// hostHas: that read named this host registered with key (NVMe, whose
// registration belongs to the host and covers each of its controllers):
// nothing is sent, since an NVMe REGISTER of the key a host has succeeds
// and counts a generation at the target, where SCSI refuses it and
// changes nothing.
func (n *nodeServer) registerPaths(s *stageRun, key uint64, ours, hostHas bool) (made []*devices.Device, allNew bool, err error) {
	if hostHas {
		s.registered = true
		return nil, false, nil
	}
	paths, err := n.a.pr.paths(s.dev)
	if err != nil {
		return nil, false, fmt.Errorf("volume %q: fence: %w", s.id, err)
	}
	for _, p := range paths {
		m, err := registerPath(n.a.pr, p, key, ours)
		if err != nil {
			return nil, false, n.fenceError(s, err)
		}
		if m {
			made = append(made, p)
		}
		s.registered = true
	}
	n.a.paths.set(s.id, paths)
	return made, len(paths) > 0 && len(made) == len(paths), nil
}

// stillHeld checks, after a stage whose read found key registered made
// new registrations of it (made), that key still holds the volume
// through a nexus the stage did not register: a preempt that came
// between the stage's read and its REGISTERs removed every registration
// of key, and the ones made after it would let this node write under the
// other node's reservation (see newpath.go, whose check this is). If
// not, they are removed again and the stage is refused.
func (n *nodeServer) stillHeld(s *stageRun, f prDevice, mode string, key uint64, made []*devices.Device) error {
	after, rerr := readFence(f)
	// NVMe lists a key once per host, however many controllers made the
	// host's registration: there only the holder can be checked.
	others := s.dev.ID.Kind == devices.KindNVMe || countKey(after.Keys, key) > len(made)
	if rerr == nil && holdsFence(mode, key, after) && others {
		return nil
	}
	var errs []error
	for _, p := range made {
		pf, err := n.a.pr.open(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := pf.Register(key, 0, false); err != nil && !errors.Is(err, devices.ErrReservationConflict) {
			errs = append(errs, err)
		}
		pf.Close()
	}
	if rerr != nil {
		return fmt.Errorf("volume %q: fence: read the reservation after registering the paths %s: %w", s.id, pathNames(made), errors.Join(append([]error{rerr}, errs...)...))
	}
	if len(errs) == 0 {
		s.registered = false
	}
	return errdefs.FailedPrecondition("volume %q: this node's key lost the volume while the stage registered its paths (%s): this node may no longer write it; the new registrations were removed again%s",
		s.id, n.a.fenceLoss(key, after), joinedErr(errs))
}

func pathNames(ps []*devices.Device) string {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Path
	}
	return strings.Join(names, ", ")
}

func joinedErr(errs []error) string {
	if len(errs) == 0 {
		return ""
	}
	return " (but not all: " + errors.Join(errs...).Error() + ")"
}

// reclaimHolder moves the node's reservation onto the device's own I_T
// nexuses when every one of them had to be registered by this stage
// while the node's key holds it: the key holds it through nexuses the
// node no longer has. A SCSI registration belongs to an I_T nexus, and
// an iSCSI session logged out and in again is another one (a new ISID),
// as every session after a reboot may be. Left there, the reservation
// outlives the unstage: its RELEASE goes through a nexus that does not
// hold it, which releases nothing (GOOD status, as SPC says), and the
// next node is refused until an operator moves the volume. A PREEMPT of
// the node's own key through the device makes the nexus it goes through
// the holder and removes the key's other registrations, the stale ones
// with them; the device's other paths are registered again. (NVMe
// registers hosts, not nexuses: a controller that connects again is the
// same registrant.)
func (n *nodeServer) reclaimHolder(ctx context.Context, s *stageRun, f prDevice, key uint64) error {
	if err := f.Preempt(key, key, fenceType, false); err != nil {
		return n.fenceError(s, err)
	}
	if _, _, err := n.registerPaths(s, key, true, false); err != nil {
		return err
	}
	s.log.InfoContext(ctx, "fenced: the node's key held the reservation through I_T nexuses it no longer has (sessions logged in again); moved it to the device's",
		slog.String("key", fmt.Sprintf("%#016x", key)))
	return nil
}

// registerPath registers key through p, and says whether the path had
// no registration before (made). REGISTER with the old key 0 is refused
// (a conflict, which changes nothing) when the nexus is registered
// already. Its key is then this node's if the device's keys include it
// (ours; fenceStage refused keys berth did not make, and no other node
// has this node's nexus), and nothing is changed: a repeated stage leaves
// the target's generation as it was. Otherwise REGISTER from key to key
// tells, succeeding only if the registration is this node's.
func registerPath(h prHost, p *devices.Device, key uint64, ours bool) (made bool, err error) {
	f, err := h.open(p)
	if err != nil {
		return false, err
	}
	defer f.Close()
	err = f.Register(0, key, false)
	switch {
	case err == nil:
		return true, nil
	case !errors.Is(err, devices.ErrReservationConflict):
		return false, err
	case ours:
		return false, nil
	}
	if err := f.Register(key, key, false); err != nil {
		if errors.Is(err, devices.ErrReservationConflict) {
			return false, errdefs.FailedPrecondition("path %s is registered with a key that is not this node's; berth leaves it alone", p.Path)
		}
		return false, err
	}
	return false, nil
}

// unregisterPaths removes key from every path of d where it is
// registered, and nothing else: REGISTER from key to 0 conflicts on a
// nexus without key, which is then left alone.
func unregisterPaths(h prHost, d *devices.Device, key uint64) error {
	paths, err := h.paths(d)
	if err != nil {
		return err
	}
	var errs []error
	for _, p := range paths {
		f, err := h.open(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := f.Register(key, 0, false); err != nil && !errors.Is(err, devices.ErrReservationConflict) {
			errs = append(errs, err)
		}
		f.Close()
	}
	return errors.Join(errs...)
}

// authorizeTakeover asks the configured authorities, in order, whether
// the volume held by victim has moved to this node. The first that
// allows it decides; otherwise the refusal carries every reason.
func (n *nodeServer) authorizeTakeover(ctx context.Context, s *stageRun, victim uint64) (TakeoverDecision, error) {
	req := TakeoverRequest{VolumeID: s.id, NodeID: n.a.cfg.NodeID, Holder: victim, PublishContext: s.pctx}
	var refused TakeoverDecision
	var reasons []string
	var errs []error
	for _, a := range n.a.cfg.Takeover {
		d, err := a.AuthorizeTakeover(ctx, req)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if d.Allowed {
			return d, nil
		}
		if refused.HolderNode == "" {
			refused.HolderNode = d.HolderNode
		}
		if d.Reason != "" {
			reasons = append(reasons, d.Reason)
		}
	}
	if len(n.a.cfg.Takeover) == 0 {
		reasons = append(reasons, "no takeover authority is configured")
	}
	for _, err := range errs {
		reasons = append(reasons, "an authority failed: "+err.Error())
	}
	refused.Reason = strings.Join(reasons, "; ")
	return refused, nil
}

// refuseTakeover ends a stage that found the volume held by victim and
// may not take it: it unregisters a registration of this node's key left
// by an earlier attempt (a crash between register and reserve), touches
// nothing else, and answers FAILED_PRECONDITION naming the holder.
func (n *nodeServer) refuseTakeover(ctx context.Context, s *stageRun, f prDevice, key uint64, ours bool, victim uint64, d TakeoverDecision) error {
	if ours {
		if res, err := f.ReadReservation(); err == nil && res.Holder != key {
			if err := unregisterPaths(n.a.pr, s.dev, key); err != nil {
				s.log.WarnContext(ctx, "unregister this node's key left by an earlier attempt", slog.String("error", err.Error()))
			}
		}
	}
	why := ""
	if d.Reason != "" {
		why = " (" + d.Reason + ")"
	}
	return errdefs.FailedPrecondition("volume %q: held at the target by %s; the volume has not been given to this node%s: it stages here once that node unstages it, or once the cluster (or an operator: berth takeover) moves it here",
		s.id, n.a.describeHolder(victim, d.HolderNode), why)
}

// lostRace ends a stage whose reserve conflicted with another node's
// that reserved between this stage's read and reserve: this node's key
// is unregistered again and the winner named.
func (n *nodeServer) lostRace(ctx context.Context, s *stageRun, f prDevice, key uint64) error {
	if err := unregisterPaths(n.a.pr, s.dev, key); err != nil {
		s.log.WarnContext(ctx, "unregister this node's key after losing the reservation", slog.String("error", err.Error()))
	} else {
		s.registered = false
	}
	holder := uint64(0)
	if res, err := f.ReadReservation(); err == nil {
		holder = res.Holder
	}
	return errdefs.FailedPrecondition("volume %q: another node reserved it at the same time: held by %s; it stages here once that node unstages it", s.id, n.a.describeHolder(holder, ""))
}

// takeOver preempts victim (and any other node's key registered) with
// abort, so that their queued writes never land, and takes the
// reservation.
func (n *nodeServer) takeOver(ctx context.Context, s *stageRun, f prDevice, key, victim uint64, ours bool, others []uint64, d TakeoverDecision) error {
	if err := n.recordFence(s, fenceReserve, key); err != nil {
		return err
	}
	if _, _, err := n.registerPaths(s, key, ours, false); err != nil {
		return err
	}
	victims := []uint64{victim}
	for _, k := range others {
		if !slices.Contains(victims, k) {
			victims = append(victims, k)
		}
	}
	for _, v := range victims {
		if err := f.Preempt(key, v, fenceType, true); err != nil {
			return n.fenceError(s, err)
		}
	}
	if err := f.Reserve(key, fenceType); err != nil {
		return n.fenceError(s, err)
	}
	s.took.mark("takeover")
	s.log.WarnContext(ctx, "took the volume over: preempted the holder's reservation and aborted its commands",
		slog.String("holder", n.a.describeHolder(victim, d.HolderNode)), slog.String("reason", d.Reason), slog.String("key", fmt.Sprintf("%#016x", key)))
	return nil
}

// fenceError names a fencing failure for the CO. A target without
// persistent reservations refuses the stage unless the volume opts out.
func (n *nodeServer) fenceError(s *stageRun, err error) error {
	if errors.Is(err, errdefs.ErrUnsupported) {
		return errdefs.FailedPrecondition("volume %q: the target of %s does not support persistent reservations (%v), so berth cannot keep a second node from writing the volume; give it volume_context %s: %q to stage it unfenced", s.id, s.dev.Path, err, ContextFencing, fenceNone)
	}
	return fmt.Errorf("volume %q: fence %s: %w", s.id, s.dev.Path, err)
}

// stillFenced checks a staged volume's fence at a repeated stage that
// finds its staging mount in place: a node that was preempted holds a
// filesystem another node has written since; it is refused.
func (n *nodeServer) stillFenced(s *stageRun) error {
	if msg := n.a.preempted(s.rec); msg != "" {
		return errdefs.FailedPrecondition("volume %q: %s: this node may no longer write it and its mounted filesystem is stale; NodeUnstageVolume it here", s.id, msg)
	}
	return nil
}

// fenceCondition is the volume's condition as fencing sees it: abnormal
// when another node preempted it; nil otherwise.
func (a *Agent) fenceCondition(rec *volumeRecord) *csi.VolumeCondition {
	if msg := a.preempted(rec); msg != "" {
		return &csi.VolumeCondition{Abnormal: true, Message: msg + ": this node's writes fail at the target"}
	}
	return nil
}

// unfencedReason says why a volume that fencing applies to has none, ""
// when it is fenced or fencing does not apply: opted out (fenceNone), a
// target without reservations (fenceUnavailable), or a volume staged by
// a berth that did not fence (no fence recorded), which the next stage
// that goes through the device fences.
func (rec *volumeRecord) unfencedReason() string {
	switch {
	case rec.Fence == nil:
		mode := csi.VolumeCapability_AccessMode_Mode(csi.VolumeCapability_AccessMode_Mode_value[rec.Mode])
		if rec.Staged && rec.Device != nil && fenceApplies(rec.Device.Kind, mode) != "" {
			return "staged by a berth that did not fence volumes: it is fenced once staged again after an unstage"
		}
	case rec.Fence.Mode == fenceNone:
		return fmt.Sprintf("opted out with volume_context %s: %q", ContextFencing, fenceNone)
	case rec.Fence.Mode == fenceUnavailable:
		return "the target has no persistent reservations: its NVMe controller lists none, as nvmet's before Linux 6.13 do"
	}
	return ""
}

// optedOut reports whether a volume was staged with volume_context
// fencing "none".
func (rec *volumeRecord) optedOut() bool { return rec.Fence != nil && rec.Fence.Mode == fenceNone }

// undoFence gives back the fence a failed stage took, before its detach.
func (n *nodeServer) undoFence(ctx context.Context, s *stageRun) error {
	if !s.registered {
		return nil
	}
	if err := n.a.unfence(ctx, s.rec, false); err != nil {
		return err
	}
	s.registered = false
	return nil
}
