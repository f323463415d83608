package iscsi

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/failpoint"
	"github.com/berth-csi/berth/internal/logctx"
)

// Preflight checks the secrets the volume needs, the iscsi_tcp module
// and the initiator name, changing nothing.
func (tg *Target) Preflight(context.Context) error {
	if err := tg.v.CheckSecrets(); err != nil {
		return err
	}
	return tg.t.preflight(tg.v)
}

// Attach logs in to the volume's portals, scans in exactly its LUN and
// returns the verified device: the multipath map over all paths when the
// volume is multipathed, the disk itself otherwise. It is idempotent: an
// existing session and LUN are reused.
func (tg *Target) Attach(ctx context.Context) (_ *devices.Device, retErr error) {
	t, v := tg.t, tg.v
	if err := v.CheckSecrets(); err != nil {
		return nil, err
	}
	if err := t.preflight(v); err != nil {
		return nil, err
	}
	multipath, err := t.wantMultipath(ctx, v)
	if err != nil {
		return nil, err
	}
	paths, errs := resolve(ctx, v.Portals)
	if len(paths) == 0 {
		return nil, errors.Join(errs...)
	}
	if v.Discovery {
		if err := t.discover(ctx, v, paths); err != nil {
			return nil, err
		}
	}

	var attached []*pathDevice
	defer func() {
		if retErr != nil {
			for _, pd := range attached {
				if err := t.detachPath(context.WithoutCancel(ctx), v, pd.path); err != nil {
					logctx.From(ctx, t.log).Warn("undo iSCSI login after failed attach", "target", v, "portal", pd.path.String(), "error", err)
				}
			}
		}
	}()
	var fatal error
	for _, p := range paths {
		pd, err := t.attachPath(ctx, v, p)
		if err != nil {
			errs = append(errs, fmt.Errorf("portal %s: %w", p, err))
			if errors.Is(err, errdefs.ErrPermissionDenied) || errors.Is(err, errdefs.ErrFailedPrecondition) ||
				errors.Is(err, errdefs.ErrNotFound) || ctx.Err() != nil {
				// Wrong credentials, wrong LUN or WWID: the next portal
				// of the same target will say the same.
				fatal = err
				break
			}
			continue
		}
		attached = append(attached, pd)
		if !multipath {
			break
		}
	}
	if len(attached) == 0 {
		return nil, fmt.Errorf("attach iSCSI %s LUN %d: %w", v.IQN, v.LUN, errors.Join(errs...))
	}
	if retErr = ctx.Err(); retErr != nil {
		return nil, retErr
	}
	if fatal != nil {
		// A fatal error after some paths attached (auth on the second
		// portal): refuse rather than run degraded on a misconfiguration.
		return nil, fmt.Errorf("attach iSCSI %s LUN %d: %w", v.IQN, v.LUN, errors.Join(errs...))
	}
	for _, e := range errs {
		if multipath {
			logctx.From(ctx, t.log).Warn("iSCSI path not attached; the volume runs degraded", "target", v, "error", e)
		} else {
			logctx.From(ctx, t.log).Info("iSCSI portal did not answer; the next one is used", "target", v, "error", e)
		}
	}
	wwid := attached[0].dev.ID.WWID
	for _, pd := range attached[1:] {
		if devices.NormalizeWWID(pd.dev.ID.WWID) != devices.NormalizeWWID(wwid) {
			return nil, fmt.Errorf("iSCSI %s LUN %d: portal %s shows WWID %s but portal %s shows %s: the portals do not lead to the same LUN: %w",
				v.IQN, v.LUN, attached[0].path, wwid, pd.path, pd.dev.ID.WWID, errdefs.ErrFailedPrecondition)
		}
	}
	if !multipath {
		// A multipathd configured to claim every disk may have built a
		// map over the single path; then only the map is usable.
		if dm := t.mapOf(attached); dm != nil {
			return dm, nil
		}
		return attached[0].dev, nil
	}
	return t.waitMap(ctx, wwid, attached)
}

// pathDevice is one attached path: its session and SCSI disk.
type pathDevice struct {
	path path
	sess *Session
	hctl HCTL
	dev  *devices.Device
}

// preflight checks what every login needs and says what to fix.
func (t *Transport) preflight(v *Volume) error {
	if v.Iface == "default" {
		if _, err := os.Stat(t.sys.path("class", "iscsi_transport", "tcp")); err != nil {
			return unavailable("the iscsi_tcp kernel module is not loaded (no %s): run `modprobe iscsi_tcp` on the node and add it to /etc/modules-load.d", t.sys.path("class", "iscsi_transport", "tcp"))
		}
	}
	if _, err := ReadInitiatorName(t.opts.InitiatorNameFile); err != nil {
		return unavailable("no usable iSCSI initiator name: %v; install open-iscsi on the node (it generates one) or write InitiatorName=iqn.… into it (iscsi-iname generates one) and restart iscsid", err)
	}
	return nil
}

// wantMultipath decides whether the volume is a multipath map.
func (t *Transport) wantMultipath(ctx context.Context, v *Volume) (bool, error) {
	switch {
	case v.Multipath == "false":
		return false, nil
	case v.Multipath == "auto" && len(v.Portals) < 2:
		return false, nil
	}
	if err := t.multipathdRunning(ctx); err != nil {
		if v.Multipath == "true" {
			return false, fmt.Errorf("volume_context multipath=true: %w", err)
		}
		return false, fmt.Errorf("volume lists %d portals, which needs dm-multipath: %w; to use a single path instead, set volume_context %s: \"false\"",
			len(v.Portals), err, KeyMultipath)
	}
	return true, nil
}

func (t *Transport) multipathdRunning(ctx context.Context) error {
	out, err := t.run.run(ctx, t.opts.Multipathd, "show", "daemon")
	if err != nil {
		return unavailable("multipathd is not running or not reachable (%v): install multipath-tools and start multipathd on the node", err)
	}
	if s := strings.TrimSpace(string(out)); strings.Contains(s, "fail") || s == "" {
		return unavailable("multipathd answered %q to `show daemon`: start multipathd on the node", s)
	}
	return nil
}

// findSession returns the session of target through p on iface, or nil.
func (t *Transport) findSession(target string, p path, iface string) (*Session, error) {
	sessions, err := t.sys.Sessions(target)
	if err != nil {
		return nil, err
	}
	for i := range sessions {
		if sessions[i].Matches(target, p.IP, p.Port, iface) {
			return &sessions[i], nil
		}
	}
	return nil, nil
}

// attachPath logs in through one portal (or reuses the session), scans the
// LUN and waits for its disk.
func (t *Transport) attachPath(ctx context.Context, v *Volume, p path) (_ *pathDevice, retErr error) {
	start := time.Now()
	key := p.key(v.IQN, v.Iface)
	unlock, err := t.locks.lock(ctx, key)
	if err != nil {
		return nil, err
	}
	locked := true
	defer func() {
		if locked {
			unlock()
		}
	}()

	sess, err := t.findSession(v.IQN, p, v.Iface)
	if err != nil {
		return nil, err
	}
	// removed: the WWID check took out a disk this attach did not scan
	// in (another storage object now behind the LUN number).
	loggedIn, scanned, removed := false, false, false
	if sess == nil {
		if err := t.login(ctx, v, p); err != nil {
			return nil, err
		}
		loggedIn = true
		failpoint.Hit("iscsi.logged_in")
		if sess, err = t.findSession(v.IQN, p, v.Iface); err != nil {
			return nil, err
		}
		if sess == nil {
			return nil, fmt.Errorf("iscsiadm logged in to %s at %s but no session shows in %s: %w",
				v.IQN, p, t.sys.path("class", "iscsi_session"), errdefs.ErrUnavailable)
		}
	}
	var hctl HCTL
	defer func() {
		if retErr == nil || (!scanned && !loggedIn && !removed) {
			return
		}
		if !locked {
			// The wait for the disk ran without the path's lock; its
			// undo takes it again, as a detach would.
			unlock, err := t.locks.lock(context.WithoutCancel(ctx), key)
			if err != nil {
				logctx.From(ctx, t.log).Warn("undo failed attach", "target", v, "portal", p.String(), "error", err)
				return
			}
			defer unlock()
		}
		if scanned {
			// Take out the disk this attach scanned in, so that the
			// session can go too.
			if err := t.removeDisk(context.WithoutCancel(ctx), sess, hctl); err != nil {
				logctx.From(ctx, t.log).Warn("remove disk after failed attach", "target", v, "hctl", hctl.String(), "error", err)
			}
		}
		// Under the lock, a session without LUNs is nobody's: an attach
		// that let the lock go has its LUN in the session. This one's
		// LUN may have been all that kept a detach of another LUN,
		// which ran while it waited for its disk, from logging out.
		if err := t.logoutIfUnused(context.WithoutCancel(ctx), v, p, sess); err != nil {
			logctx.From(ctx, t.log).Warn("log out after failed attach", "target", v, "portal", p.String(), "error", err)
		}
	}()

	// The waiter exists before the scan, so the disk's uevent cannot be
	// missed; Wait also checks sysfs first for a disk already there.
	w := t.opts.Listener.Subscribe(devices.MatchSCSIAddress(sess.Host, 0, sess.TargetID, v.LUN))
	defer w.Close()

	hctl, ok, err := t.sessionLUN(sess.ID, v.LUN)
	if err != nil {
		return nil, err
	}
	if !ok {
		scanned = true
		if err := t.sys.Scan(sess, v.LUN); err != nil {
			return nil, fmt.Errorf("scan LUN %d of %s: %w", v.LUN, v.IQN, err)
		}
		failpoint.Hit("iscsi.scanned")
		// The scan write returns once the kernel probed the LUN: if no
		// SCSI device exists now, the target has no such LUN.
		if hctl, ok, err = t.sessionLUN(sess.ID, v.LUN); err != nil {
			return nil, err
		}
		if !ok {
			scanned = false
			return nil, fmt.Errorf("target %s has no LUN %d (portal %s, session %d): check the volume's lun and the target's LUN mapping for this initiator: %w",
				v.IQN, v.LUN, p, sess.ID, errdefs.ErrNotFound)
		}
	} else if sess.State == "LOGGED_IN" && t.sys.SCSIDeviceState(hctl) == "running" {
		// A disk already there shows the identity the kernel read when
		// it was scanned in; the target may have put other storage
		// behind the LUN number since. The rescan reads it again (and
		// the capacity), so that the WWID checked is the current one.
		if err := t.sys.Rescan(hctl); err != nil {
			logctx.From(ctx, t.log).Debug("rescan the existing disk of the LUN", "hctl", hctl.String(), "error", err)
		}
	}
	scannedAt := time.Now()
	// The SCSI device of the LUN exists now, so a detach of another LUN
	// of this session leaves the session logged in: the wait for the
	// disk (the kernel's sd probe and its uevent) needs no lock, and the
	// next LUN's scan can start meanwhile.
	unlock()
	locked = false
	if t.testHookDiskWait != nil {
		t.testHookDiskWait(v.LUN)
	}
	dev, err := w.Wait(ctx)
	if err != nil {
		return nil, fmt.Errorf("wait for the disk of %s LUN %d (%s; sysfs shows %s): %w", v.IQN, v.LUN, hctl, t.describeLUN(hctl), err)
	}
	logctx.From(ctx, t.log).Debug("iSCSI path attached", "portal", p.String(), "session", sess.ID, "hctl", hctl.String(), "device", dev.Path,
		"logged_in", loggedIn, "scanned", scanned, "login_scan", scannedAt.Sub(start), "device_wait", time.Since(scannedAt))
	if dev.ID.WWID == "" {
		if w, err := readAttr(t.sys.path("class", "scsi_device", hctl.String(), "device", "wwid")); err == nil {
			dev.ID.WWID = w
		}
	}
	if v.WWID != "" && devices.NormalizeWWID(dev.ID.WWID) != devices.NormalizeWWID(v.WWID) {
		err := fmt.Errorf("iSCSI %s LUN %d (%s, %s) has WWID %q but the volume expects %q; refusing to use it: %w",
			v.IQN, v.LUN, dev.Path, hctl, dev.ID.WWID, v.WWID, errdefs.ErrFailedPrecondition)
		if rerr := t.removeDisk(context.WithoutCancel(ctx), sess, hctl); rerr != nil {
			err = errors.Join(err, rerr)
		}
		removed = !scanned
		return nil, err
	}
	return &pathDevice{path: p, sess: sess, hctl: hctl, dev: dev}, nil
}

// describeLUN tells what sysfs has at h, for errors.
func (t *Transport) describeLUN(h HCTL) string {
	name, err := t.sys.BlockDevice(h)
	if err != nil {
		return fmt.Sprintf("no disk (SCSI device state %q)", t.sys.SCSIDeviceState(h))
	}
	d, err := t.devs.Lookup(name)
	if err != nil {
		return fmt.Sprintf("disk %s unreadable: %v", name, err)
	}
	return fmt.Sprintf("disk %s kind %q hctl %q wwid %q size %d", d.Name, d.ID.Kind, d.ID.HCTL, d.ID.WWID, d.Size)
}

// sessionLUN finds the SCSI device of lun in the session.
func (t *Transport) sessionLUN(sid, lun int) (HCTL, bool, error) {
	luns, err := t.sys.LUNs(sid)
	if err != nil {
		return HCTL{}, false, err
	}
	for _, h := range luns {
		if h.LUN == lun {
			return h, true, nil
		}
	}
	return HCTL{}, false, nil
}

// recordSettings are written into every node record berth creates.
func (t *Transport) recordSettings(v *Volume) []setting {
	set := []setting{
		{"node.startup", "manual"},
		// Only the LUN a volume names is ever scanned in.
		{"node.session.scan", "manual"},
	}
	params := map[string]int{}
	for k, n := range t.opts.Params {
		params[k] = n
	}
	for k, n := range v.Params {
		params[k] = n
	}
	for _, k := range []string{ParamReplacementTimeout, ParamLoginTimeout, ParamLoginRetryMax} {
		if n, ok := params[k]; ok {
			set = append(set, setting{k, strconv.Itoa(n)})
		}
	}
	if c := v.SessionCHAP; c != nil {
		set = append(set,
			setting{"node.session.auth.authmethod", "CHAP"},
			setting{SecretSessionUsername, c.Username},
			setting{SecretSessionPassword, c.Password})
		if c.Mutual() {
			set = append(set,
				setting{SecretSessionUsernameIn, c.UsernameIn},
				setting{SecretSessionPasswordIn, c.PasswordIn})
		}
	}
	return set
}

// login creates the node record for exactly this target and portal, writes
// its settings and credentials, and logs in.
func (t *Transport) login(ctx context.Context, v *Volume, p path) (retErr error) {
	start := time.Now()
	// On the default interface berth writes the record itself, as
	// iscsiadm would; otherwise (or before open-iscsi made its record
	// directory) iscsiadm creates it and berth adds the settings.
	native, file := false, ""
	if v.Iface == "default" {
		f, err := t.db.createNodeRecord(ctx, v.IQN, p.IP, p.Port, p.TPGT, t.recordSettings(v))
		switch {
		case err == nil:
			native, file = true, f
		case !errors.Is(err, errdefs.ErrNotFound):
			return err
		}
	}
	if !native {
		if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsNodeNew(v.IQN, p.IP, p.Port, p.TPGT, v.Iface)...); err != nil {
			return t.iscsiadmError("create node record", err)
		}
	}
	defer func() {
		logctx.From(ctx, t.log).Debug("iSCSI login", "portal", p.String(), "duration", time.Since(start), "error", retErr)
	}()
	defer func() {
		if retErr != nil {
			// Leave no record (and no credentials) behind for a login
			// that did not happen: the file berth wrote, and whatever
			// record iscsiadm knows of.
			if native {
				if err := t.db.remove(context.WithoutCancel(ctx), file); err != nil {
					logctx.From(ctx, t.log).Warn("delete node record after failed login", "target", v, "portal", p.String(), "error", err)
				}
			}
			if _, err := t.run.run(context.WithoutCancel(ctx), t.opts.Iscsiadm, argsNodeDelete(v.IQN, p.IP, p.Port, v.Iface)...); err != nil && command.ExitCode(err) != ISCSI_ERR_NO_OBJS_FOUND {
				logctx.From(ctx, t.log).Warn("delete node record after failed login", "target", v, "portal", p.String(), "error", err)
			}
		}
	}()
	if !native {
		files, err := t.db.nodeRecordFiles(v.IQN, p.IP, p.Port, v.Iface)
		if err != nil {
			return fmt.Errorf("iscsiadm created the node record of %s at %s, but berth cannot find it (name open-iscsi's record directory with --iscsi-node-dir): %w", v.IQN, p, err)
		}
		if err := t.db.update(ctx, files, t.recordSettings(v)); err != nil {
			return err
		}
	}
	failpoint.Hit("iscsi.record_written")
	_, err := t.run.run(ctx, t.opts.Iscsiadm, argsNodeLogin(v.IQN, p.IP, p.Port, p.TPGT, v.Iface)...)
	if native && command.ExitCode(err) == ISCSI_ERR_NO_OBJS_FOUND {
		dir, _ := t.db.nodeDir()
		return fmt.Errorf("log in to %s at %s: iscsiadm found no node record, though berth wrote it in %s: this iscsiadm keeps its records elsewhere: name its directory with --iscsi-node-dir: %w",
			v.IQN, p, dir, errdefs.ErrUnavailable)
	}
	if err != nil && command.ExitCode(err) != ISCSI_ERR_SESS_EXISTS {
		return t.iscsiadmError(fmt.Sprintf("log in to %s at %s", v.IQN, p), err)
	}
	return nil
}

// iscsiadmError adds what to do to the errors an operator can fix.
func (t *Transport) iscsiadmError(op string, err error) error {
	switch command.ExitCode(err) {
	case ISCSI_ERR_LOGIN_AUTH_FAILED:
		return fmt.Errorf("%s: CHAP authentication failed: check the user names and secrets in the volume's node-stage secret against the target's ACL: %w", op, err)
	case ISCSI_ERR_ISCSID_NOTCONN, ISCSI_ERR_ISCSID_COMM_ERR:
		return fmt.Errorf("%s: iscsid is not running or not reachable: start it on the node (systemctl enable --now iscsid); in a container, use --iscsiadm with a wrapper that runs the host's iscsiadm: %w", op, err)
	case ISCSI_ERR_TRANS_NOT_FOUND:
		return fmt.Errorf("%s: the iSCSI transport module is not loaded: run `modprobe iscsi_tcp` on the node: %w", op, err)
	case ISCSI_ERR_TRANS_TIMEOUT:
		return fmt.Errorf("%s: the portal did not answer: check the address, the port and the network path: %w", op, err)
	}
	var ee *command.Error
	if errors.As(err, &ee) && ee.ExitCode < 0 && errors.Is(err, fs.ErrNotExist) {
		return unavailable("%s: %s not found: install open-iscsi or set --iscsiadm", op, t.opts.Iscsiadm)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// Detach removes the LUN's device (and its multipath map) and logs out of
// each session that no longer has any LUN. Sessions that other volumes
// still use stay. It needs no secrets and is idempotent.
func (tg *Target) Detach(ctx context.Context) error {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return err
	}
	// Nothing is removed while something still uses the LUN: a mount of
	// its filesystem outside the staging path (a bind that leaked into
	// another mount namespace), a process that opened it exclusively.
	if err := inUse(t.mapOf(pds), pds); err != nil {
		return fmt.Errorf("detach iSCSI %s LUN %d: %w", v.IQN, v.LUN, err)
	}
	var errs []error
	// The map first: removing a path under a map would make it queue or
	// fail I/O.
	if dm := t.mapOf(pds); dm != nil {
		if err := t.removeMap(ctx, dm); err != nil {
			return fmt.Errorf("detach iSCSI %s LUN %d: %w", v.IQN, v.LUN, err)
		}
	}
	seen := map[string]bool{}
	for _, pd := range pds {
		seen[pd.path.key(v.IQN, v.Iface)] = true
		if err := t.detachPath(ctx, v, pd.path); err != nil {
			errs = append(errs, err)
		}
	}
	// Portals without a session: drop leftover records (a crash between
	// record creation and login).
	for _, p := range paths {
		if seen[p.key(v.IQN, v.Iface)] {
			continue
		}
		if err := t.detachPath(ctx, v, p); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("detach iSCSI %s LUN %d: %w", v.IQN, v.LUN, errors.Join(errs...))
	}
	return nil
}

// inUse checks the LUN's map, or without one each of its disks, with
// devices.InUse.
func inUse(dm *devices.Device, pds []*pathDevice) error {
	if dm != nil {
		return devices.InUse(dm)
	}
	for _, pd := range pds {
		if pd.dev == nil {
			continue
		}
		if err := devices.InUse(pd.dev); err != nil {
			return err
		}
	}
	return nil
}

// StopQueueing makes the LUN's device fail I/O when none of its paths
// works, so that an unmount or a flush ends instead of waiting in the
// kernel for a path that may never come back. A multipath map (with
// queue_if_no_path, or multipathd's no_path_retry queue) is told to fail
// I/O. A LUN without a map queues on its session's disk until the
// session's replacement timeout: when no session of the LUN is logged in,
// each session that carries this LUN alone is logged out, which fails the
// queued I/O at once, as Detach would after the unmount; a session other
// LUNs share is left to recover or time out. A device with a working path
// is left as it is.
func (tg *Target) StopQueueing(ctx context.Context) (bool, error) {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return false, err
	}
	dm := t.mapOf(pds)
	if dm == nil {
		return t.stopDiskQueueing(ctx, v, pds)
	}
	ps, err := devices.MultipathPaths(dm)
	if err != nil {
		return false, err
	}
	if slices.ContainsFunc(ps, devices.PathState.Working) {
		return false, nil
	}
	if err := t.failQueueing(ctx, dm); err != nil {
		return false, fmt.Errorf("iSCSI %s LUN %d: no path works: %w", v.IQN, v.LUN, err)
	}
	logctx.From(ctx, t.log).Warn("iSCSI: no path works; the multipath map fails I/O instead of queueing it", "target", v.IQN, "lun", v.LUN, "map", mapName(dm))
	return true, nil
}

// stopDiskQueueing is StopQueueing for a LUN without a multipath map.
func (t *Transport) stopDiskQueueing(ctx context.Context, v *Volume, pds []*pathDevice) (bool, error) {
	if len(pds) == 0 || slices.ContainsFunc(pds, func(pd *pathDevice) bool { return pd.sess.State == "LOGGED_IN" }) {
		return false, nil
	}
	for _, pd := range pds {
		if err := t.logoutFailed(ctx, v, pd.path); err != nil {
			return true, fmt.Errorf("iSCSI %s LUN %d: no session is logged in: %w", v.IQN, v.LUN, err)
		}
	}
	return true, nil
}

// logoutFailed logs out of the session through p when it is not logged
// in and carries no LUN but v's, so that the disk's queued I/O fails now
// rather than at the replacement timeout.
func (t *Transport) logoutFailed(ctx context.Context, v *Volume, p path) error {
	unlock, err := t.locks.lock(ctx, p.key(v.IQN, v.Iface))
	if err != nil {
		return err
	}
	defer unlock()
	sess, err := t.findSession(v.IQN, p, v.Iface)
	if err != nil || sess == nil || sess.State == "LOGGED_IN" {
		return err
	}
	luns, err := t.sys.LUNs(sess.ID)
	if err != nil {
		return err
	}
	if len(luns) > 1 || (len(luns) == 1 && luns[0].LUN != v.LUN) {
		logctx.From(ctx, t.log).Warn("iSCSI: no session is logged in; other LUNs share the session, so the disk queues I/O until the session's replacement timeout", "target", v.IQN, "lun", v.LUN, "session", sess.ID, "state", sess.State)
		return nil
	}
	if err := t.logout(ctx, v, p, sess); err != nil {
		return err
	}
	logctx.From(ctx, t.log).Warn("iSCSI: no session is logged in; logged out of the LUN's session so that its disk fails I/O instead of queueing it", "target", v.IQN, "lun", v.LUN, "session", sess.ID, "state", sess.State)
	return nil
}

// findPaths returns the volume's LUN on every session of its target: the
// sessions through its resolved portals, and, for portals that did not
// resolve, any session of the target on the interface.
func (t *Transport) findPaths(v *Volume, paths []path) ([]*pathDevice, error) {
	sessions, err := t.sys.Sessions(v.IQN)
	if err != nil {
		return nil, err
	}
	unresolved := len(paths) < len(v.Portals)
	var out []*pathDevice
	for i := range sessions {
		s := &sessions[i]
		if s.Target != v.IQN || s.Iface != v.Iface {
			continue
		}
		var p *path
		for j := range paths {
			if s.Matches(v.IQN, paths[j].IP, paths[j].Port, v.Iface) {
				p = &paths[j]
				break
			}
		}
		if p == nil {
			if !unresolved {
				continue
			}
			p = &path{Portal: Portal{Host: s.PersistentAddress, Port: s.PersistentPort, TPGT: -1}, IP: s.PersistentAddress}
		}
		pd := &pathDevice{path: *p, sess: s}
		if h, ok, err := t.sessionLUN(s.ID, v.LUN); err != nil {
			return nil, err
		} else if ok {
			pd.hctl = h
			if name, err := t.sys.BlockDevice(h); err == nil {
				pd.dev, _ = t.devs.Lookup(name)
			}
		} else if unresolved && p.IP == s.PersistentAddress && !t.portalListed(v, p) {
			continue // a session of the target this volume has no LUN on
		}
		out = append(out, pd)
	}
	return out, nil
}

func (t *Transport) portalListed(v *Volume, p *path) bool {
	for _, q := range v.Portals {
		if q.Host == p.IP && q.Port == p.Port {
			return true
		}
	}
	return false
}

// detachPath removes the LUN's disk from the session through p and logs
// out when the session has no LUN left. No session: the record is deleted.
func (t *Transport) detachPath(ctx context.Context, v *Volume, p path) error {
	unlock, err := t.locks.lock(ctx, p.key(v.IQN, v.Iface))
	if err != nil {
		return err
	}
	defer unlock()
	sess, err := t.findSession(v.IQN, p, v.Iface)
	if err != nil {
		return err
	}
	if sess == nil {
		return t.deleteRecord(ctx, v, p)
	}
	if sess.State != "LOGGED_IN" {
		// The target is unreachable: the disk's queue is blocked until
		// the replacement timeout, and deleting it would wait that long
		// to flush its cache. When the LUN is all the session has, the
		// logout takes the disk with it, at once.
		luns, err := t.sys.LUNs(sess.ID)
		if err != nil {
			return err
		}
		if len(luns) == 0 || (len(luns) == 1 && luns[0].LUN == v.LUN) {
			return t.logout(ctx, v, p, sess)
		}
	}
	if h, ok, err := t.sessionLUN(sess.ID, v.LUN); err != nil {
		return err
	} else if ok {
		if err := t.removeDisk(ctx, sess, h); err != nil {
			return err
		}
		failpoint.Hit("iscsi.disk_removed")
	}
	return t.logoutIfUnused(ctx, v, p, sess)
}

// removeDisk flushes and deletes the SCSI disk h of sess. When the session
// is not logged in (target gone), the disk is set offline first so that
// its removal does not wait for the session's replacement timeout.
//
// h was read from the session's LUNs a moment ago; a SCSI host's number
// goes to the next session as soon as its own session logs out (a
// crashed agent's logout may still finish meanwhile), and h then names
// another session's LUN. So the device is opened once and checked to
// still be a LUN of sess, and it is set offline and deleted through that
// descriptor; its disk, if it has one, is removed as the device that
// descriptor shows.
//
// The whole removal runs in the background (see inflight): setting a
// device offline, reading it and deleting it may each wait in the kernel
// while its session recovers, and no RPC may outlive its deadline.
func (t *Transport) removeDisk(ctx context.Context, sess *Session, h HCTL) error {
	key := fmt.Sprintf("session%d/%s", sess.ID, h)
	return t.removals.remove(ctx, key, fmt.Sprintf("SCSI device %s of session %d", h, sess.ID), func(ctx context.Context) error {
		return t.removeDiskNow(ctx, sess, h)
	})
}

func (t *Transport) removeDiskNow(ctx context.Context, sess *Session, h HCTL) error {
	lun, err := t.sys.openLUN(sess.ID, h)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil // gone, or another session's now
	}
	if err != nil {
		return err
	}
	defer lun.Close()
	if lun.state() == "running" {
		if cur, err := t.sys.Session(sess.ID); err == nil && cur.State != "LOGGED_IN" {
			if err := lun.offline(); err != nil {
				logctx.From(ctx, t.log).Debug("set SCSI device offline before removal", "hctl", h.String(), "error", err)
			}
		}
	}
	name, err := lun.blockDevice()
	if err == nil {
		dev, err := t.devs.Lookup(name)
		if err == nil && dev.ID.HCTL != h.String() {
			// The disk name went to another device after the one read
			// through the descriptor: nothing of h's is left to remove.
			return nil
		}
		if err == nil {
			if err := devices.RemoveSCSIDevice(ctx, t.opts.Listener, dev); err != nil {
				return fmt.Errorf("remove SCSI disk %s (%s): %w", dev.Path, h, err)
			}
			return nil
		}
		if !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
	}
	// A SCSI device without a disk (never opened, or its disk already
	// gone): delete it directly.
	if err := lun.delete(); err != nil {
		return fmt.Errorf("remove SCSI device %s: %w", h, err)
	}
	return nil
}

// inflight runs each disk removal once, in the background: the kernel's
// delete of a disk whose target is unreachable blocks until the session's
// replacement timeout, and no RPC may outlive its deadline. A retry of the
// same removal waits for the one in flight.
type inflight struct {
	mu sync.Mutex
	m  map[string]chan struct{}
	e  map[string]error
}

func (in *inflight) remove(ctx context.Context, key, what string, fn func(context.Context) error) error {
	in.mu.Lock()
	if in.m == nil {
		in.m, in.e = map[string]chan struct{}{}, map[string]error{}
	}
	done, running := in.m[key]
	if !running {
		done = make(chan struct{})
		in.m[key] = done
		// The removal's own bound is generous; the caller's deadline
		// only bounds how long the caller waits.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), removeBound)
		go func() {
			defer cancel()
			err := fn(rctx)
			in.mu.Lock()
			in.e[key] = err
			delete(in.m, key)
			close(done)
			in.mu.Unlock()
		}()
	}
	in.mu.Unlock()
	select {
	case <-done:
		in.mu.Lock()
		err := in.e[key]
		delete(in.e, key)
		in.mu.Unlock()
		return err
	case <-ctx.Done():
		return fmt.Errorf("remove %s: the kernel is still deleting it (a disk of an unreachable target waits for the session's replacement timeout); retry later: %w", what,
			errors.Join(errdefs.ErrUnavailable, ctx.Err()))
	}
}

// removeBound caps a background disk removal.
const removeBound = 15 * time.Minute

// logoutIfUnused logs out of sess when it has no SCSI device left, and
// deletes the node record with it.
func (t *Transport) logoutIfUnused(ctx context.Context, v *Volume, p path, sess *Session) error {
	luns, err := t.sys.LUNs(sess.ID)
	if err != nil {
		return err
	}
	if len(luns) > 0 {
		logctx.From(ctx, t.log).Debug("iSCSI session kept: other LUNs use it", "session", sess.ID, "target", v.IQN, "luns", len(luns))
		return nil
	}
	return t.logout(ctx, v, p, sess)
}

// logout logs out of sess and deletes its node record.
func (t *Transport) logout(ctx context.Context, v *Volume, p path, sess *Session) error {
	if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsSessionLogout(sess.ID)...); err != nil {
		switch command.ExitCode(err) {
		case ISCSI_ERR_SESS_NOT_FOUND, ISCSI_ERR_NO_OBJS_FOUND:
		default:
			return t.iscsiadmError(fmt.Sprintf("log out of session %d (%s at %s)", sess.ID, v.IQN, p), err)
		}
	}
	failpoint.Hit("iscsi.logged_out")
	return t.deleteRecord(ctx, v, p)
}

func (t *Transport) deleteRecord(ctx context.Context, v *Volume, p path) error {
	// Where the record directory is visible and holds no record of the
	// portal there is nothing to delete, and iscsiadm is not asked: a
	// stage that failed before its login (iscsi_tcp not loaded, say)
	// must unstage on a node where iscsiadm is missing too.
	if _, err := t.db.nodeRecordFiles(v.IQN, p.IP, p.Port, v.Iface); errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsNodeDelete(v.IQN, p.IP, p.Port, v.Iface)...); err != nil {
		if c := command.ExitCode(err); c == ISCSI_ERR_NO_OBJS_FOUND || c == ISCSI_ERR_SESS_NOT_FOUND {
			return nil
		}
		return t.iscsiadmError(fmt.Sprintf("delete the node record of %s at %s", v.IQN, p), err)
	}
	return nil
}

// Expand rescans every path of the LUN, resizes its multipath map and
// returns the new size once every path and the map report it.
func (tg *Target) Expand(ctx context.Context) (int64, error) {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return 0, err
	}
	var size int64 = -1
	for _, pd := range pds {
		if pd.dev == nil {
			continue
		}
		if err := t.sys.Rescan(pd.hctl); err != nil {
			return 0, fmt.Errorf("rescan %s (%s): %w", pd.dev.Path, pd.hctl, err)
		}
		// The rescan write returns after READ CAPACITY: the size is
		// current now.
		d, err := t.devs.Lookup(pd.dev.Name)
		if err != nil {
			return 0, err
		}
		if size >= 0 && d.Size != size {
			return 0, fmt.Errorf("iSCSI %s LUN %d: path %s reports %d bytes, another path %d: %w", v.IQN, v.LUN, d.Path, d.Size, size, errdefs.ErrUnavailable)
		}
		size = d.Size
	}
	if size < 0 {
		return 0, fmt.Errorf("iSCSI %s LUN %d is not attached on this node: %w", v.IQN, v.LUN, errdefs.ErrNotFound)
	}
	dm := t.mapOf(pds)
	if dm == nil {
		return size, nil
	}
	return t.resizeMap(ctx, dm, size)
}

// ExpandTo is Expand for a caller that knows the size the LUN should have:
// a LUN still smaller after the rescan (the storage has not grown it yet)
// is an error the caller may retry.
func (tg *Target) ExpandTo(ctx context.Context, minBytes int64) (int64, error) {
	size, err := tg.Expand(ctx)
	if err != nil {
		return 0, err
	}
	if size < minBytes {
		return size, fmt.Errorf("iSCSI %s LUN %d reports %d bytes after a rescan, fewer than the %d requested: grow the LUN on the storage first: %w",
			tg.v.IQN, tg.v.LUN, size, minBytes, errdefs.ErrUnavailable)
	}
	return size, nil
}

// Health reports paths whose session is not logged in or whose disk is not
// running.
func (tg *Target) Health(ctx context.Context) (bool, string) {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return true, err.Error()
	}
	var bad []string
	up := 0
	if v.Multipath == "true" || v.Multipath == "auto" && len(v.Portals) > 1 {
		// Every portal of a multipath volume is one of its paths: one
		// without a session (its login never succeeded: the portal
		// dropped the connection attempts or refused them) is a path
		// down, though sysfs knows nothing of it.
		for _, p := range paths {
			found := false
			for _, pd := range pds {
				found = found || pd.path.key(v.IQN, v.Iface) == p.key(v.IQN, v.Iface)
			}
			if !found {
				bad = append(bad, fmt.Sprintf("portal %s: no session (login failed or never tried)", p))
			}
		}
		if len(paths) < len(v.Portals) {
			bad = append(bad, fmt.Sprintf("%d of %d portals do not resolve", len(v.Portals)-len(paths), len(v.Portals)))
		}
	}
	for _, pd := range pds {
		switch {
		case pd.dev == nil:
			bad = append(bad, fmt.Sprintf("portal %s: LUN %d not present", pd.path, v.LUN))
		case pd.sess.State != "LOGGED_IN":
			bad = append(bad, fmt.Sprintf("portal %s: session %d is %s", pd.path, pd.sess.ID, pd.sess.State))
		case t.sys.SCSIDeviceState(pd.hctl) != "running":
			bad = append(bad, fmt.Sprintf("portal %s: %s is %s", pd.path, pd.dev.Name, t.sys.SCSIDeviceState(pd.hctl)))
		default:
			up++
		}
	}
	if up == 0 {
		bad = append([]string{fmt.Sprintf("no working path to %s LUN %d", v.IQN, v.LUN)}, bad...)
	}
	if len(bad) > 0 {
		return true, strings.Join(bad, "; ")
	}
	return false, fmt.Sprintf("%d path(s) up", up)
}
