package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Transport connects the volumes of one kind of storage: "file" (an image
// file on a loop device), "nvmeof", "iscsi". Each lives in its own
// package, which does not import agent; TransportFunc adapts it.
type Transport interface {
	// Name is the value of volume_context "transport" that selects it.
	Name() string
	// Keys are the volume_context keys that select it when "transport"
	// is absent (see TransportKind.Keys).
	Keys() []string
	// Parse validates volume_context (merged with publish_context) and
	// the request's secrets and returns the target they name. It has no
	// side effects. Unstage after a restart calls Parse with the stored
	// context and nil secrets, so a Target must be able to Detach without
	// secrets.
	Parse(volumeContext, secrets map[string]string) (Target, error)
}

// TransportKind declares a transport berth knows, whether or not this
// node serves it. Each transport's package declares its name and keys.
type TransportKind struct {
	// Name is the value of volume_context "transport" that selects it.
	Name string
	// Keys are the volume_context keys that select it when "transport"
	// is absent: a context holding one of them, and none of another
	// transport's, is this transport's. No two transports share a key.
	Keys []string
}

// Target is one volume of a transport.
type Target interface {
	// Key is the canonical form of what the volume_context names: equal
	// keys mean the same storage. It needs nothing but the context, so a
	// volume's recorded key still compares after the storage is gone; a
	// repeated stage must name the volume by the same key.
	Key() string
	// Preflight checks, without changing anything on the node, what
	// Attach needs from it (kernel modules, tools, the image file).
	// NodeStageVolume calls it before it records the volume, so that a
	// node that cannot attach the target refuses the stage with nothing
	// left behind for NodeUnstageVolume to clear.
	Preflight(ctx context.Context) error
	// Identity is the identity of the storage object itself, which other
	// names of it share (a hard link to an image): file: the image's
	// device and inode numbers; iSCSI: target name and LUN, whatever the
	// portal; NVMe-oF: subsystem NQN and namespace, whatever the address.
	// It may look at the node (the file transport stats the image) but
	// changes nothing. Storage that cannot be looked at now (an image
	// that is gone) gives an error wrapping errdefs.ErrNotFound.
	Identity() (string, error)
	// Attach connects the target and returns its verified block device.
	// It is idempotent: an attached target returns its device.
	Attach(ctx context.Context) (*devices.Device, error)
	// StopQueueing makes the target's device fail I/O instead of
	// queueing it when no path to the storage works (a dm-multipath map
	// with queue_if_no_path, an NVMe head whose controllers reconnect
	// forever), and reports whether none works. NodeUnstageVolume calls
	// it before it unmounts and flushes: an unmount of a filesystem whose
	// device queues I/O waits in the kernel until a path comes back,
	// beyond any deadline. A device with a working path is left as it
	// is. A transport whose devices never queue (file) answers false.
	StopQueueing(ctx context.Context) (unreachable bool, err error)
	// ResumeQueueing undoes what StopQueueing changed where it can, for
	// an unstage that did not finish: a multipath map that queued I/O
	// queues it again. What cannot come back without the stage's
	// secrets (a controller deleted, a session logged out) is left to
	// the next stage. It is idempotent, and a target StopQueueing left
	// as it was is left so again.
	ResumeQueueing(ctx context.Context) error
	// Detach disconnects the target; a target already gone is success.
	// It refuses (errdefs.ErrBusy) while the device is still mounted or
	// held, and names what holds it. rec is what the stage recorded
	// about the device, nil when the record has none (a stage
	// interrupted before it recorded one). A target whose storage is
	// named by a path that may lead elsewhere by the time the volume is
	// unstaged (an image file renamed, or replaced by a symbolic link to
	// another file with a loop device of its own) detaches the device
	// rec names and nothing else: one no longer bound to that storage
	// is gone already. Without rec.Loop (no record, or a record of an
	// earlier version) it finds its device by the path.
	Detach(ctx context.Context, rec *devices.Recorded) error
	// Expand makes the node see the target's current size (rescan) and
	// returns the device size in bytes.
	Expand(ctx context.Context) (int64, error)
	// ExpandTo is Expand for a caller that knows the size the CO asked
	// for (minBytes > 0): it returns once the device reports at least
	// that, waiting, bounded by ctx, where a new size shows up
	// asynchronously (an NVMe namespace's AEN), and an error the CO may
	// retry while the storage has not grown yet.
	ExpandTo(ctx context.Context, minBytes int64) (int64, error)
	// PathStates counts the target's paths to its storage by state
	// ("live" for a working one; NVMe/TCP controllers, iSCSI sessions):
	// the berth_volume_paths metric. A target without several paths (an
	// image file) returns nil.
	PathStates(ctx context.Context) (map[string]int, error)
	// Health reports whether the connection to the target is abnormal.
	Health(ctx context.Context) (abnormal bool, message string)
}

// TransportFunc makes a Transport of a package whose Parse returns its
// own target type (so that it need not import agent):
//
//	agent.TransportFunc(agent.TransportKind{Name: iscsi.Name, Keys: iscsi.TransportKeys()}, t.Parse)
func TransportFunc[T Target](kind TransportKind, parse func(volumeContext, secrets map[string]string) (T, error)) Transport {
	return funcTransport[T]{kind: kind, parse: parse}
}

type funcTransport[T Target] struct {
	kind  TransportKind
	parse func(volumeContext, secrets map[string]string) (T, error)
}

func (f funcTransport[T]) Name() string { return f.kind.Name }

func (f funcTransport[T]) Keys() []string { return slices.Clone(f.kind.Keys) }

func (f funcTransport[T]) Parse(vc, secrets map[string]string) (Target, error) {
	t, err := f.parse(vc, secrets)
	if err != nil {
		return nil, err // never a typed nil inside the interface
	}
	return t, nil
}

// ContextTransport is the volume_context key that names the transport.
const ContextTransport = "transport"

// impliedTransports maps each volume_context key that selects a
// transport, of the transports served and of those declared disabled, to
// that transport's name. A transport named twice, or a key claimed by
// two transports, is an error.
func impliedTransports(enabled []Transport, disabled []TransportKind) (map[string]string, error) {
	kinds := make([]TransportKind, 0, len(enabled)+len(disabled))
	for _, t := range enabled {
		kinds = append(kinds, TransportKind{Name: t.Name(), Keys: t.Keys()})
	}
	kinds = append(kinds, disabled...)
	names := make(map[string]bool, len(kinds))
	implied := make(map[string]string)
	for _, k := range kinds {
		if k.Name == "" {
			return nil, fmt.Errorf("transport with keys %q: no name", k.Keys)
		}
		if names[k.Name] {
			return nil, fmt.Errorf("transport %q: declared twice (enabled twice, or both enabled and disabled)", k.Name)
		}
		names[k.Name] = true
		for _, key := range k.Keys {
			if key == "" || key == ContextTransport {
				return nil, fmt.Errorf("transport %q: volume_context key %q cannot select a transport", k.Name, key)
			}
			if other, ok := implied[key]; ok {
				return nil, fmt.Errorf("volume_context key %q: selects both transport %q and %q", key, other, k.Name)
			}
			implied[key] = k.Name
		}
	}
	return implied, nil
}

// transportName returns the transport a volume_context asks for: the
// "transport" key, or the one its keys imply (implied maps a key to the
// transport it selects).
func transportName(vc map[string]string, implied map[string]string) (string, error) {
	if name, ok := vc[ContextTransport]; ok {
		if name == "" {
			return "", errdefs.InvalidArgument("volume_context[%q]: empty", ContextTransport)
		}
		return name, nil
	}
	var found []string
	for k, t := range implied {
		if _, ok := vc[k]; ok && !slices.Contains(found, t) {
			found = append(found, t)
		}
	}
	sort.Strings(found)
	switch len(found) {
	case 0:
		if len(implied) == 0 {
			return "", errdefs.InvalidArgument("volume_context: names no transport (set %q)", ContextTransport)
		}
		keys := slices.Sorted(maps.Keys(implied))
		return "", errdefs.InvalidArgument("volume_context: names no transport (set %q, or give a key that selects one: %q)", ContextTransport, keys)
	case 1:
		return found[0], nil
	}
	return "", errdefs.InvalidArgument("volume_context: keys of several transports %v; set %q to choose", found, ContextTransport)
}

// selectTransport finds the enabled transport for a volume_context.
func selectTransport(vc map[string]string, implied map[string]string, ts map[string]Transport) (Transport, error) {
	name, err := transportName(vc, implied)
	if err != nil {
		return nil, err
	}
	t, ok := ts[name]
	if !ok {
		names := make([]string, 0, len(ts))
		for n := range ts {
			names = append(names, n)
		}
		sort.Strings(names)
		return nil, errdefs.InvalidArgument("volume_context: transport %q is not enabled on this node (enabled: %v)", name, names)
	}
	return t, nil
}

func deviceRecordOf(d *devices.Device) *deviceRecord {
	r := &deviceRecord{
		Name: d.Name, Path: d.Path, Major: d.Major, Minor: d.Minor, Size: d.Size,
		DiskSeq: d.DiskSeq,
		Kind:    d.ID.Kind, WWID: d.ID.WWID, HCTL: d.ID.HCTL,
		NQN: d.ID.NQN, NSID: d.ID.NSID, UUID: d.ID.UUID, NGUID: d.ID.NGUID,
		BackingFile: d.ID.BackingFile, DMName: d.ID.DMName,
	}
	if ref, ok := d.LoopRef(); ok {
		r.BackingDev, r.BackingIno = ref.BackingDev, ref.BackingIno
	}
	return r
}

func describeDevice(d *devices.Device) string {
	if d == nil {
		return "<none>"
	}
	return fmt.Sprintf("%s (%d:%d)", d.Path, d.Major, d.Minor)
}
