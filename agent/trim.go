package agent

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/lockfile"
)

// Space reclaim: the filesystem of a staged mount volume is trimmed
// (FITRIM, see fs.Trim) at its staging path, so that the blocks its files
// no longer use are discarded down to the thin LUN, namespace or image
// file below it. berth trim does it on request, berth serve
// --trim-interval once per interval. Trims of one volume never overlap,
// whichever process runs them: each holds the volume's lock file in
// StateDir/trim (flock, not waited for), and NodeUnstageVolume takes it
// too, so that it does not unmount under a trim.

// TrimResult is the outcome of the trim of one volume: Trimmed bytes,
// or why it was Skipped, or the Err of a trim that failed.
type TrimResult struct {
	VolumeID string
	Trimmed  uint64
	Skipped  string
	Err      error
}

// trimBusy is the reason a trim of a volume being trimmed is skipped.
const trimBusy = "a trim is in progress"

// trimLockDir is the directory of the volumes' trim locks.
func trimLockDir(stateDir string) string { return filepath.Join(stateDir, "trim") }

// trimLock is a held trim lock of a volume.
type trimLock struct {
	l    *lockfile.Lock
	path string
}

// lockTrim takes the trim lock of volume id without waiting: nil, nil
// when another process or call holds it.
func lockTrim(stateDir, id string) (*trimLock, error) {
	dir := trimLockDir(stateDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create trim lock directory: %w", err)
	}
	p := filepath.Join(dir, strings.TrimSuffix(stateFileName(id), ".json")+".lock")
	l, err := lockfile.Acquire(p)
	var held *lockfile.HeldError
	if errors.As(err, &held) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &trimLock{l: l, path: p}, nil
}

// Close releases the lock; the file stays for the next trim.
func (t *trimLock) Close() error { return t.l.Close() }

// remove deletes the lock file of a volume gone from the node, then
// releases the lock. A trim that opened the file before sees no record
// of the volume, or no mount of it, and trims nothing.
func (t *trimLock) remove() error {
	err := os.Remove(t.path)
	return errors.Join(err, t.l.Close())
}

// lockTrimForUnstage takes the volume's trim lock for NodeUnstageVolume:
// a trim holds the staging mount open, which the unmount would wait
// for. A trim in progress answers Aborted; the CO retries.
func (a *Agent) lockTrimForUnstage(id string) (*trimLock, error) {
	l, err := lockTrim(a.cfg.StateDir, id)
	if err != nil {
		return nil, fmt.Errorf("volume %q: %w", id, err)
	}
	if l == nil {
		return nil, fmt.Errorf("volume %q: %s (berth trim, or berth serve's periodic trim); unstage when it ends: %w", id, trimBusy, errdefs.ErrBusy)
	}
	return l, nil
}

// trimSkip is why a record's volume is not trimmed, "" when it is to be.
func trimSkip(rec *volumeRecord) string {
	switch {
	case !rec.Staged:
		return "its stage did not complete"
	case rec.AccessType == "block":
		return "a raw block volume: berth has no filesystem on it to trim (the workload that uses the device can discard)"
	case rec.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY.String(),
		rec.Mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY.String():
		return "staged read-only (access mode " + rec.Mode + "): a trim writes to the filesystem"
	case slices.Contains(rec.MountFlags, "ro"):
		return "staged read-only (mount flag ro): a trim writes to the filesystem"
	}
	return ""
}

// trimRecord trims the volume of rec at its staging path, once the
// staging path is checked to be the root of a mount of the volume's
// device (openStagingMount); the trim is made through the descriptor
// that check opened.
func (a *Agent) trimRecord(ctx context.Context, rec *volumeRecord) TrimResult {
	res := TrimResult{VolumeID: rec.VolumeID}
	if res.Skipped = trimSkip(rec); res.Skipped != "" {
		return res
	}
	l, err := lockTrim(a.cfg.StateDir, rec.VolumeID)
	if err != nil {
		res.Err = fmt.Errorf("volume %q: %w", rec.VolumeID, err)
		return res
	}
	if l == nil {
		res.Skipped = trimBusy
		return res
	}
	defer l.Close()
	h, err := a.openStagingMount(rec)
	if err != nil {
		res.Err = err
		return res
	}
	defer h.Close()
	if res.Trimmed, err = a.host.Trim(ctx, h); err != nil {
		res.Err = fmt.Errorf("volume %q: %w", rec.VolumeID, err)
	}
	return res
}

// TrimVolumes trims the volumes ids (every volume recorded when ids is
// empty) of the berth whose state directory is stateDir, from the
// records there: what berth trim runs, beside a berth serve that holds
// the directory. A volume without a record is an error in its result; so
// is a record that cannot be read.
func TrimVolumes(ctx context.Context, stateDir string, ids []string) ([]TrimResult, error) {
	if stateDir == "" || !filepath.IsAbs(stateDir) {
		return nil, fmt.Errorf("state directory %q: want an absolute path", stateDir)
	}
	vdir := filepath.Join(stateDir, "volumes")
	// Not New: the running berth holds the state directory's lock. A
	// trim needs only the host and the directory.
	a := &Agent{cfg: Config{StateDir: stateDir}, host: newHostFS()}
	var out []TrimResult
	if len(ids) == 0 {
		entries, err := os.ReadDir(vdir)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("read state directory: %w", err)
		}
		for _, e := range entries {
			if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".tmp-") {
				continue
			}
			p := filepath.Join(vdir, e.Name())
			rec, err := readRecord(p)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				continue // unstaged meanwhile
			case err != nil:
				out = append(out, TrimResult{Err: fmt.Errorf("state file %s cannot be read: %w", p, err)})
			case stateFileName(rec.VolumeID) != e.Name():
				out = append(out, TrimResult{VolumeID: rec.VolumeID, Err: fmt.Errorf("state file %s holds volume %q, whose record belongs in %s", p, rec.VolumeID, stateFileName(rec.VolumeID))})
			default:
				out = append(out, a.trimRecord(ctx, rec))
			}
		}
		return out, nil
	}
	for _, id := range ids {
		if err := validateVolumeID(id); err != nil {
			out = append(out, TrimResult{VolumeID: id, Err: err})
			continue
		}
		p := filepath.Join(vdir, stateFileName(id))
		rec, err := readRecord(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			err = fmt.Errorf("volume %q is not staged on this node (no record in %s): %w", id, vdir, errdefs.ErrNotFound)
		case err != nil:
			err = fmt.Errorf("volume %q: state file %s cannot be read: %w", id, p, err)
		case rec.VolumeID != id:
			err = fmt.Errorf("volume %q: state file %s holds volume %q", id, p, rec.VolumeID)
		}
		if err != nil {
			out = append(out, TrimResult{VolumeID: id, Err: err})
			continue
		}
		out = append(out, a.trimRecord(ctx, rec))
	}
	return out, nil
}

// trimOffset is where in each interval volume id is trimmed: spread by
// a hash of the ID, so that the volumes of a node do not trim at once.
func trimOffset(id string, interval time.Duration) time.Duration {
	h := fnv.New64a()
	h.Write([]byte(id))
	return time.Duration(h.Sum64() % uint64(interval))
}

// nextTrim is the first time at or after now that is volume id's offset
// into an interval (intervals counted from the zero time).
func nextTrim(id string, now time.Time, interval time.Duration) time.Time {
	t := now.Truncate(interval).Add(trimOffset(id, interval))
	if t.Before(now) {
		t = t.Add(interval)
	}
	return t
}

// trimLoop trims each staged volume once per interval, at its offset,
// until ctx ends. A volume with an RPC in progress (a stage, an unstage)
// is not waited for: it is trimmed at its next turn. Volumes that are
// never trimmed (raw block, read-only: see trimSkip) get no turn, and so
// no result in the metrics.
func (a *Agent) trimLoop(ctx context.Context, interval time.Duration) {
	due := make(map[string]time.Time)
	// Volumes staged meanwhile are seen at the next wake-up.
	const maxSleep = time.Minute
	for {
		now := time.Now()
		recs := a.state.list()
		seen := make(map[string]bool, len(recs))
		wake := now.Add(min(interval, maxSleep))
		for _, rec := range recs {
			if trimSkip(rec) != "" {
				continue
			}
			id := rec.VolumeID
			seen[id] = true
			t, ok := due[id]
			if !ok {
				t = nextTrim(id, now, interval)
			}
			if !t.After(now) {
				a.trimTurn(ctx, id)
				t = nextTrim(id, now.Add(time.Nanosecond), interval)
			}
			due[id] = t
			if t.Before(wake) {
				wake = t
			}
		}
		for id := range due {
			if !seen[id] {
				delete(due, id)
			}
		}
		timer := time.NewTimer(time.Until(wake))
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

// trimTurn is the periodic trim of volume id, under the volume's lock.
func (a *Agent) trimTurn(ctx context.Context, id string) {
	log := a.log.With(slog.String("volume_id", id))
	res := TrimResult{VolumeID: id}
	start := time.Now()
	if unlock, err := a.locks.tryLock(volumeKey(id)); err != nil {
		res.Skipped = "a call on the volume is in progress; it is trimmed at its next turn"
	} else {
		rec, ok := a.state.get(id)
		if ok {
			res = a.trimRecord(ctx, rec)
		}
		unlock()
		if !ok {
			return // unstaged meanwhile
		}
	}
	switch {
	case res.Err != nil:
		log.WarnContext(ctx, "periodic trim failed", slog.String("error", res.Err.Error()))
	case res.Skipped != "":
		log.DebugContext(ctx, "periodic trim skipped", slog.String("reason", res.Skipped))
	default:
		log.InfoContext(ctx, "trimmed", slog.Uint64("bytes", res.Trimmed), slog.Duration("duration", time.Since(start)))
	}
	if a.cfg.OnTrim != nil {
		a.cfg.OnTrim(res)
	}
}
