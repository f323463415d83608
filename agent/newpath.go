package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Paths that join a staged volume. A stage registers the node's key on
// every path its dm-multipath map has then. A path that joins the map
// later (a portal that was down at the stage answers again and is logged
// in, a session logged in again with a new ISID, multipathd adding a
// disk it claimed late) is another SCSI I_T nexus, without a
// registration: under Write Exclusive – Registrants Only the target
// refuses its writes with a reservation conflict, which dm-multipath
// hands to the filesystem instead of trying another path. Serve watches
// the maps of the fenced volumes (watchPaths) and registers such a path.
//
// A node that another node preempted must never register again: every
// registrant may write, so a registration through a new path would undo
// the fence. A new path is therefore registered only while the node's
// key still holds the volume at the target (holdsFence: registered, and
// the reservation is the key's, or no one's for a multi-node volume),
// and the registration is checked afterwards: the key must still be
// registered through a nexus other than the new one. A preempt (or a
// clear) removes every registration of the key at once and nothing but
// this node's own calls, serialised by the volume's lock, registers the
// key again, so such a registration proves that no preempt came between
// the check before and the check after. When it is missing, the new
// registration is removed at once and the volume is reported preempted
// (its condition reads the target). What remains is a preempt that lands
// between the check before and the REGISTER: the new nexus may then
// write for as long as the check after and the unregistration take (a
// few round trips to the target; a read that meets a unit attention is
// sent twice).
//
// NVMe registers hosts, not connections: a controller that connects
// later is the registrant the host already is, and has nothing to
// register. Neither has a volume on a single SCSI disk: a session logged
// in again makes another disk, which the staged volume does not use.

// newPathRecheck is how often watchPaths looks at the maps without an
// event: it misses none that a full uevent queue dropped, and it retries
// a volume that was busy with a call of the CO.
const newPathRecheck = 30 * time.Second

// pathBook remembers, per volume, the paths of its map known to carry
// the node's registration (or one berth leaves alone), and the paths it
// refused to register (logged once, and left alone until the next
// stage). The zero value is ready.
type pathBook struct {
	mu      sync.Mutex
	known   map[string]map[string]bool // volume ID -> pathKey
	refused map[string]map[string]bool
}

// pathKeyOf identifies a path device: a name that returns for another
// disk has another disk sequence number, and a disk of another session
// another SCSI host (HCTL), also on a kernel without disk sequence
// numbers.
func pathKeyOf(p *devices.Device) string {
	return fmt.Sprintf("%s %d:%d %d %s", p.Name, p.Major, p.Minor, p.DiskSeq, p.ID.HCTL)
}

// set records that paths are the volume's registered paths (a stage
// registered every one).
func (b *pathBook) set(id string, paths []*devices.Device) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.known == nil {
		b.known, b.refused = map[string]map[string]bool{}, map[string]map[string]bool{}
	}
	m := make(map[string]bool, len(paths))
	for _, p := range paths {
		m[pathKeyOf(p)] = true
	}
	b.known[id] = m
	delete(b.refused, id)
}

// add records one path of the volume as known.
func (b *pathBook) add(id string, p *devices.Device) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.known == nil {
		b.known, b.refused = map[string]map[string]bool{}, map[string]map[string]bool{}
	}
	if b.known[id] == nil {
		b.known[id] = map[string]bool{}
	}
	b.known[id][pathKeyOf(p)] = true
}

// unknown are the paths the book neither knows nor refused for the
// volume. A refused path is not looked at again until a stage sets the
// book: the key lost the volume, which nothing but a stage gives back,
// and each look would hold the volume's lock while it reads the target,
// on every uevent of a node whose paths fail, refusing the CO's calls on
// the volume as busy.
func (b *pathBook) unknown(id string, paths []*devices.Device) []*devices.Device {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(paths), func(p *devices.Device) bool {
		k := pathKeyOf(p)
		return b.known[id][k] || b.refused[id][k]
	})
}

// refuse records that p was not registered: unknown leaves it out from
// then on, so each refusal is logged once.
func (b *pathBook) refuse(id string, p *devices.Device) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.refused == nil {
		b.known, b.refused = map[string]map[string]bool{}, map[string]map[string]bool{}
	}
	if b.refused[id] == nil {
		b.refused[id] = map[string]bool{}
	}
	b.refused[id][pathKeyOf(p)] = true
}

// keep forgets the volumes for which recorded is false. It is asked
// under the book's lock, at the time of the deletion: a stage records
// its volume before it registers and sets the book.
func (b *pathBook) keep(recorded func(id string) bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for id := range b.known {
		if !recorded(id) {
			delete(b.known, id)
		}
	}
	for id := range b.refused {
		if !recorded(id) {
			delete(b.refused, id)
		}
	}
}

// watchPaths registers the paths that join the maps of fenced volumes
// (see above), until ctx ends: at once, then on every block uevent that
// adds or changes a device (a disk that appears, a map that multipathd
// loads again), and every newPathRecheck.
func (a *Agent) watchPaths(ctx context.Context, every time.Duration) {
	kick := make(chan struct{}, 1)
	if a.listener != nil {
		stop := a.listener.Notify(func(e devices.EventInfo) {
			if e.Action == "add" || e.Action == "change" {
				select {
				case kick <- struct{}{}:
				default:
				}
			}
		})
		defer stop()
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		a.registerNewPaths(ctx)
		select {
		case <-ctx.Done():
			return
		case <-kick:
		case <-tick.C:
		}
	}
}

// registerNewPaths registers the new paths of every fenced volume, and
// forgets the paths of volumes that are gone.
func (a *Agent) registerNewPaths(ctx context.Context) {
	for _, rec := range a.state.list() {
		if ctx.Err() != nil {
			return
		}
		if watchesPaths(rec) {
			a.registerNewPathsOf(ctx, rec.VolumeID)
		}
	}
	a.paths.keep(func(id string) bool { _, ok := a.state.get(id); return ok })
}

// watchesPaths reports whether rec is of a staged volume whose key is
// registered path by path: a fenced dm-multipath map.
func watchesPaths(rec *volumeRecord) bool {
	return rec.Staged && rec.Fence != nil && rec.Fence.Key != 0 &&
		(rec.Fence.Mode == fenceReserve || rec.Fence.Mode == fenceRegister) &&
		rec.Device != nil && rec.Device.Kind == devices.KindDM
}

// newPaths are the paths of the volume's map the book does not know, nil
// when the device is gone or its paths are not SCSI disks.
func (a *Agent) newPaths(rec *volumeRecord) (*devices.Device, []*devices.Device) {
	d := a.recordedDevice(rec.Device)
	if d == nil {
		return nil, nil
	}
	paths, err := a.pr.paths(d)
	if err != nil || slices.ContainsFunc(paths, func(p *devices.Device) bool { return p.ID.Kind != devices.KindSCSI }) {
		return nil, nil
	}
	return d, a.paths.unknown(rec.VolumeID, paths)
}

// registerNewPathsOf registers the new paths of volume id's map under
// the volume's lock; a volume busy with a call is left to the next look.
func (a *Agent) registerNewPathsOf(ctx context.Context, id string) {
	rec, ok := a.state.get(id)
	if !ok || !watchesPaths(rec) {
		return
	}
	if _, cand := a.newPaths(rec); len(cand) == 0 {
		return
	}
	unlock, err := a.locks.tryLock(volumeKey(id))
	if err != nil {
		return
	}
	defer unlock()
	// Read again under the lock: a call may have changed the volume.
	if rec, ok = a.state.get(id); !ok || !watchesPaths(rec) {
		return
	}
	d, cand := a.newPaths(rec)
	if len(cand) == 0 {
		return
	}
	log := a.log.With(slog.String("volume_id", id), slog.String("device", d.Path))
	f, err := a.pr.open(d)
	if err != nil {
		log.WarnContext(ctx, "a path joined the volume's multipath map; its reservation cannot be read, so the path is not registered yet (tried again later)", slog.String("error", err.Error()))
		return
	}
	defer f.Close()
	key, mode := rec.Fence.Key, rec.Fence.Mode
	res, err := readFence(f)
	if err != nil {
		log.WarnContext(ctx, "a path joined the volume's multipath map; its reservation cannot be read, so the path is not registered yet (tried again later)", slog.String("error", err.Error()))
		return
	}
	if !holdsFence(mode, key, res) {
		for _, p := range cand {
			a.paths.refuse(id, p)
			log.WarnContext(ctx, "a path joined the volume's multipath map and is not registered: this node's key no longer holds the volume at the target ("+a.fenceLoss(key, res)+"); its writes through the map fail at the target: NodeUnstageVolume it here",
				slog.String("path", p.Path))
		}
		return
	}
	for _, p := range cand {
		err := a.registerNewPath(ctx, log, id, f, p, mode, key)
		var lost *fenceLostError
		switch {
		case errors.As(err, &lost):
			log.ErrorContext(ctx, "register a path that joined the volume's multipath map", slog.String("path", p.Path), slog.String("error", err.Error()))
			return
		case err != nil:
			log.WarnContext(ctx, "register a path that joined the volume's multipath map (tried again later)", slog.String("path", p.Path), slog.String("error", err.Error()))
			return
		}
	}
}

// readFence reads the reservation through f, twice when the first read
// fails as a unit attention does (errdefs.ErrUnavailable): a target
// reports one to each nexus once after an event (a preempt, a new
// session), and the read through a map may go down a path that has one
// waiting.
func readFence(f prDevice) (devices.Reservation, error) {
	res, err := f.ReadReservation()
	if errors.Is(err, errdefs.ErrUnavailable) {
		res, err = f.ReadReservation()
	}
	return res, err
}

// fenceLostError is the loss of the volume found after a new path was
// registered.
type fenceLostError struct{ msg string }

func (e *fenceLostError) Error() string { return e.msg }

// holdsFence reports whether key still holds the volume at the target:
// registered, and the reservation is key's (fenceReserve), or key's or
// no one's (fenceRegister).
func holdsFence(mode string, key uint64, res devices.Reservation) bool {
	if !slices.Contains(res.Keys, key) {
		return false
	}
	return res.Holder == key || (mode == fenceRegister && res.Holder == 0)
}

// fenceLoss says how key lost the volume, for a log.
func (a *Agent) fenceLoss(key uint64, res devices.Reservation) string {
	switch {
	case res.Holder != 0 && res.Holder != key:
		return "held by " + a.describeHolder(res.Holder, "")
	case !slices.Contains(res.Keys, key):
		return "the key is no longer registered"
	}
	return "not reserved by the key"
}

// registerNewPath registers key through the new path p of volume id and
// checks, through the map f, that the key still holds the volume through
// another nexus (see above); if not, or if that cannot be read, it
// removes the registration again at once and returns an error: no
// further path is registered then. A path that is registered already
// (the REGISTER conflicts, changing nothing) is left as it is.
func (a *Agent) registerNewPath(ctx context.Context, log *slog.Logger, id string, f prDevice, p *devices.Device, mode string, key uint64) error {
	pf, err := a.pr.open(p)
	if err != nil {
		return err
	}
	defer pf.Close()
	err = pf.Register(0, key, false)
	switch {
	case errors.Is(err, devices.ErrReservationConflict):
		// Registered already: by this node (a stage, or the book was
		// lost with a restart), or with a key berth leaves alone.
		a.paths.add(id, p)
		return nil
	case err != nil:
		return err
	}
	after, rerr := readFence(f)
	if rerr == nil && holdsFence(mode, key, after) && countKey(after.Keys, key) >= 2 {
		a.paths.add(id, p)
		log.InfoContext(ctx, "registered the node's reservation key on a path that joined the volume's multipath map", slog.String("path", p.Path), slog.String("key", fmt.Sprintf("%#016x", key)))
		return nil
	}
	var uerr error
	for range 2 {
		if uerr = pf.Register(key, 0, false); uerr == nil || errors.Is(uerr, devices.ErrReservationConflict) {
			uerr = nil
			break
		}
	}
	if rerr != nil {
		if uerr != nil {
			return &fenceLostError{fmt.Sprintf("the reservation could not be read after registering path %s (%v), nor the path unregistered again (%v): this node may write through it though another node may have preempted it", p.Path, rerr, uerr)}
		}
		return fmt.Errorf("the reservation could not be read after registering path %s, which was unregistered again: %w", p.Path, rerr)
	}
	a.paths.refuse(id, p)
	if uerr != nil {
		return &fenceLostError{fmt.Sprintf("this node's key lost the volume while path %s was registered (%s), and the path could not be unregistered again (%v): this node may write through it; unstage the volume here", p.Path, a.fenceLoss(key, after), uerr)}
	}
	return &fenceLostError{fmt.Sprintf("this node's key lost the volume while path %s was registered (%s); the path was unregistered again: NodeUnstageVolume the volume here", p.Path, a.fenceLoss(key, after))}
}

func countKey(keys []uint64, key uint64) int {
	n := 0
	for _, k := range keys {
		if k == key {
			n++
		}
	}
	return n
}
