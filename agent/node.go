package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// nodeServer implements the CSI Node service.
//
// Every RPC validates its request before it touches anything, then takes
// the per-volume lock (and the lock of the path it works on) without
// waiting: a second call for a busy volume answers Aborted. State is
// written before each step that changes the host, so a retry after a
// crash finds what may need finishing or undoing.
type nodeServer struct {
	csi.UnimplementedNodeServer
	a *Agent
}

var _ csi.NodeServer = (*nodeServer)(nil)

// mountOptions returns the mount(2) flags and data of a capability;
// readOnly appends "ro" last so that it wins over a "rw" in mount_flags.
func (n *nodeServer) mountOptions(c volumeCap, readOnly bool) (uintptr, string, error) {
	opts := slices.Clone(c.MountFlags)
	if readOnly {
		opts = append(opts, "ro")
	}
	return n.a.host.ParseMountOptions(opts)
}

// detach detaches the target of a volume's record, unless another volume
// uses the same storage: its loop device, session or controller is then
// that volume's too, and stays. This happens only with records written
// before berth compared identities, or with an interrupted stage that was
// refused on retry; the record is dropped either way.
func (n *nodeServer) detach(ctx context.Context, rec *volumeRecord, tr Transport, target Target) error {
	ident, err := target.Identity()
	if err != nil {
		ident = rec.TargetID // the image is gone: what it was
	}
	owner, shared := n.storageOwner(rec.VolumeID, tr, target.Key(), ident)
	if !shared && rec.Device != nil {
		owner, shared = n.deviceOwner(rec.VolumeID, rec.Device)
	}
	if shared {
		logFrom(ctx, n.a.log).WarnContext(ctx, "not detaching: another volume uses the same storage", slog.String("other_volume_id", owner))
		return nil
	}
	return target.Detach(ctx, rec.Device.recorded())
}

// lockVolumePath validates a volume ID and a path field of a request that
// names nothing else, then takes the locks of both (Aborted when busy).
func (n *nodeServer) lockVolumePath(id, field, p string) (unlock func(), err error) {
	if err := validateVolumeID(id); err != nil {
		return nil, err
	}
	if err := validatePath(field, p); err != nil {
		return nil, err
	}
	return n.a.locks.tryLock(volumeKey(id), pathKey(p))
}

// heldLocks are the locks an RPC took, which a step left running at the
// request's deadline takes over (see blocking). The zero value holds
// nothing.
type heldLocks struct{ release func() }

// Release lets the locks go, and closes what closeWith added, unless a
// step took them over; a second Release does nothing.
func (l *heldLocks) Release() {
	if l.release != nil {
		l.release()
		l.release = nil
	}
}

// closeWith makes Release, or the step that takes the locks over, call
// done before it lets the locks go.
func (l *heldLocks) closeWith(done func()) {
	release := l.release
	l.release = func() {
		done()
		if release != nil {
			release()
		}
	}
}

// handOff passes the locks to whoever calls the function it returns;
// l's Release does nothing any more.
func (l *heldLocks) handOff() func() {
	release := l.release
	l.release = nil
	if release == nil {
		return func() {}
	}
	return release
}

// blocking runs step, which may call into the kernel where a device that
// answers no I/O keeps it from returning (an unmount's writeback, a
// flush), and waits for it until ctx ends. A step still running then goes
// on in the background and takes the RPC's locks over (locks.Release
// becomes a no-op for the caller) until it returns: the volume answers
// Aborted meanwhile, and the CO's next retry finds what the step did;
// Serve waits for it before berth exits (leftRunning). The step must not
// use what the caller changes or closes after it returns; what it needs
// closed afterwards is added with locks.closeWith.
func (n *nodeServer) blocking(ctx context.Context, what string, locks *heldLocks, step func() error) error {
	done := make(chan error, 1)
	go func() { done <- step() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	release := locks.handOff()
	log := logFrom(ctx, n.a.log)
	start := time.Now()
	n.a.left.add()
	go func() {
		defer n.a.left.done()
		err := <-done
		release()
		attrs := []any{slog.String("step", what), slog.Duration("after", time.Since(start).Round(time.Millisecond))}
		if err != nil {
			attrs = append(attrs, slog.String("error", err.Error()))
		}
		log.Info("step left running at the deadline ended", attrs...)
	}()
	return fmt.Errorf("%s: still waiting in the kernel at the request's deadline (the device answers no I/O: check the paths to the storage); it goes on, and the volume is busy until it ends: %w",
		what, errors.Join(errdefs.ErrUnavailable, ctx.Err()))
}

// volumePathOf finds the record of a volume and checks that p is its
// staging path or one of its publish targets: only recorded paths are
// ever looked at, so a request cannot make berth stat or resize
// elsewhere.
func (n *nodeServer) volumePathOf(id, p string) (*volumeRecord, error) {
	rec, ok, err := n.a.state.lookup(id)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, errdefs.NotFound("volume %q: not staged on this node", id)
	}
	if _, published := rec.Publishes[p]; published || (p == rec.StagingPath && rec.Staged) {
		return rec, nil
	}
	return nil, errdefs.NotFound("volume %q: %q is neither its staging path nor a target it is published at", id, p)
}

func (n *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_VOLUME_CONDITION,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (n *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	resp := &csi.NodeGetInfoResponse{
		NodeId:            n.a.cfg.NodeID,
		MaxVolumesPerNode: n.a.cfg.MaxVolumes,
	}
	if len(n.a.cfg.Topology) > 0 {
		resp.AccessibleTopology = &csi.Topology{Segments: n.a.cfg.Topology}
	}
	return resp, nil
}

// recordedDevice looks up the device of a record and returns it only if
// it is still the same device: same numbers, same disk sequence, same
// identity. nil means gone or replaced.
func (a *Agent) recordedDevice(r *deviceRecord) *devices.Device {
	if r == nil {
		return nil
	}
	d, err := a.lookup(r.Name)
	if err != nil || !r.identifies(d) {
		return nil
	}
	return d
}
