package iscsi

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
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
	// A multipath volume needs every path: the logins run at once, so that
	// a portal that does not answer costs the stage its login timeout
	// once, not once per portal. A single-path volume takes the first
	// portal that answers, in the order listed.
	results := make([]pathResult, len(paths))
	if multipath {
		var wg sync.WaitGroup
		for i, p := range paths {
			wg.Go(func() { results[i].pd, results[i].err = t.attachPath(ctx, v, p, paths) })
		}
		wg.Wait()
	} else {
		for i, p := range paths {
			results[i].pd, results[i].err = t.attachPath(ctx, v, p, paths[i+1:])
			if results[i].err == nil || fatalAttachError(ctx, results[i].err) {
				results = results[:i+1]
				break
			}
		}
	}
	var fatal error
	for i, r := range results {
		if r.err == nil {
			attached = append(attached, r.pd)
			continue
		}
		errs = append(errs, fmt.Errorf("portal %s: %w", paths[i], r.err))
		if fatalAttachError(ctx, r.err) {
			fatal = r.err
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

// silentWindow is how long a portal whose login timed out (no answer: a
// firewall that drops packets, a dead switch port, a hung target) is left
// out of the attaches of its target's volumes, while another portal may
// serve them. A login holds its portal's lock, so without it the stages
// of several LUNs behind one silent portal wait for it in turn: three at
// once took 14, 28 and 39 s.
const silentWindow = 30 * time.Second

// silentSince reports how long ago a login through p timed out, when that
// is within silentWindow and one of others has not timed out as lately.
func (t *Transport) silentSince(v *Volume, p path, others []path) (time.Duration, bool) {
	t.silentMu.Lock()
	defer t.silentMu.Unlock()
	now := time.Now()
	recent := func(q path) (time.Duration, bool) {
		at, ok := t.silent[q.key(v.IQN, v.Iface)]
		return now.Sub(at), ok && now.Sub(at) < silentWindow
	}
	since, ok := recent(p)
	if !ok {
		return 0, false
	}
	for _, q := range others {
		if q.key(v.IQN, v.Iface) == p.key(v.IQN, v.Iface) {
			continue
		}
		if _, silent := recent(q); !silent {
			return since, true
		}
	}
	return 0, false
}

// noteSilent records whether a login through p timed out.
func (t *Transport) noteSilent(v *Volume, p path, err error) {
	t.silentMu.Lock()
	defer t.silentMu.Unlock()
	key := p.key(v.IQN, v.Iface)
	switch code := command.ExitCode(err); {
	case err == nil:
		delete(t.silent, key)
	case code == ISCSI_ERR_TRANS_TIMEOUT || code == ISCSI_ERR_PDU_TIMEOUT:
		if t.silent == nil {
			t.silent = make(map[string]time.Time)
		}
		t.silent[key] = time.Now()
	}
}

// pathResult is the outcome of one path's attach.
type pathResult struct {
	pd  *pathDevice
	err error
}

// fatalAttachError reports whether err of one portal's attach fails the
// whole attach: wrong credentials, wrong LUN or WWID (the next portal of
// the same target will say the same), or the call's end.
func fatalAttachError(ctx context.Context, err error) bool {
	return errors.Is(err, errdefs.ErrPermissionDenied) || errors.Is(err, errdefs.ErrFailedPrecondition) ||
		errors.Is(err, errdefs.ErrNotFound) || ctx.Err() != nil
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
		if _, err := os.Stat(t.sys.root.Path("class", "iscsi_transport", "tcp")); err != nil {
			return errdefs.Unavailable("the iscsi_tcp kernel module is not loaded (no %s): run `modprobe iscsi_tcp` on the node and add it to /etc/modules-load.d", t.sys.root.Path("class", "iscsi_transport", "tcp"))
		}
	}
	if _, err := ReadInitiatorName(t.opts.InitiatorNameFile); err != nil {
		return errdefs.Unavailable("no usable iSCSI initiator name: %v; install open-iscsi on the node (it generates one) or write InitiatorName=iqn.… into it (iscsi-iname generates one) and restart iscsid", err)
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
		return errdefs.Unavailable("multipathd is not running or not reachable (%v): install multipath-tools and start multipathd on the node", err)
	}
	if s := strings.TrimSpace(string(out)); strings.Contains(s, "fail") || s == "" {
		return errdefs.Unavailable("multipathd answered %q to `show daemon`: start multipathd on the node", s)
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
// LUN and waits for its disk. others are the volume's other portals that
// may serve it instead: while one of them has not timed out lately, a
// portal whose login timed out within silentWindow is not tried again.
func (t *Transport) attachPath(ctx context.Context, v *Volume, p path, others []path) (_ *pathDevice, retErr error) {
	start := time.Now()
	held, err := t.lockPath(ctx, v.IQN, p, v.Iface)
	if err != nil {
		return nil, err
	}
	defer held.Release()

	sess, err := t.findSession(v.IQN, p, v.Iface)
	if err != nil {
		return nil, err
	}
	if sess == nil {
		if since, ok := t.silentSince(v, p, others); ok {
			return nil, fmt.Errorf("not tried: a login through it timed out %s ago; it is tried again after %s: %w",
				since.Round(time.Second), silentWindow, errdefs.ErrUnavailable)
		}
	}
	// mismatched: the disk at the LUN number shows another WWID than
	// the volume's (another storage object now behind the LUN number).
	loggedIn, scanned, mismatched := false, false, false
	if sess == nil {
		err := t.login(ctx, v, p)
		t.noteSilent(v, p, err)
		if err != nil {
			// No session through p (a failed login deletes its
			// record): the path's lock file goes until the next
			// attach. A failed unlink leaves an empty file.
			_ = held.removeFile()
			return nil, err
		}
		loggedIn = true
		failpoint.Hit("iscsi.logged_in")
		if sess, err = t.findSession(v.IQN, p, v.Iface); err != nil {
			return nil, err
		}
		if sess == nil {
			return nil, fmt.Errorf("iscsiadm logged in to %s at %s but no session shows in %s: %w",
				v.IQN, p, t.sys.root.Path("class", "iscsi_session"), errdefs.ErrUnavailable)
		}
	}
	var hctl HCTL
	defer func() {
		if retErr == nil || (!scanned && !loggedIn && !mismatched) {
			return
		}
		if errors.Is(retErr, errStillWaiting) {
			// The scan has the portal's lock until the kernel ends it;
			// the next attach of the LUN, or its detach, finds what it
			// left.
			return
		}
		// An attach that failed in the wait for the disk, which runs
		// without the path's lock, takes it again for its undo, as a
		// detach would.
		if err := held.Retake(context.WithoutCancel(ctx)); err != nil {
			logctx.From(ctx, t.log).Warn("undo failed attach", "target", v, "portal", p.String(), "error", err)
			return
		}
		if scanned || mismatched {
			// Take out the disk this attach scanned in, or the one of
			// another storage object, so that the session can go too.
			if err := t.removeDisk(context.WithoutCancel(ctx), sess, hctl); err != nil {
				logctx.From(ctx, t.log).Warn("remove disk after failed attach", "target", v, "hctl", hctl.String(), "error", err)
			}
		}
		// Under the lock, a session without LUNs is nobody's: an attach
		// that let the lock go has its LUN in the session. This one's
		// LUN may have been all that kept a detach of another LUN,
		// which ran while it waited for its disk, from logging out.
		if err := t.logoutIfUnused(context.WithoutCancel(ctx), held, v, p, sess); err != nil {
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
		if err := t.scan(ctx, held, sess, v.LUN); err != nil {
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
		if err := t.rescan(ctx, held, hctl); err != nil {
			if errors.Is(err, errStillWaiting) {
				return nil, fmt.Errorf("LUN %d of %s: %w", v.LUN, v.IQN, err)
			}
			logctx.From(ctx, t.log).Debug("rescan the existing disk of the LUN", "hctl", hctl.String(), "error", err)
		}
	}
	scannedAt := time.Now()
	// The SCSI device of the LUN exists now, so a detach of another LUN
	// of this session leaves the session logged in: the wait for the
	// disk (the kernel's sd probe and its uevent) needs no lock, and the
	// next LUN's scan can start meanwhile.
	held.Release()
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
		if w, err := t.sys.root.ReadAttr("class", "scsi_device", hctl.String(), "device", "wwid"); err == nil {
			dev.ID.WWID = w
		}
	}
	if v.WWID != "" && devices.NormalizeWWID(dev.ID.WWID) != devices.NormalizeWWID(v.WWID) {
		// The undo takes the disk out, under the path's lock.
		mismatched = true
		return nil, fmt.Errorf("iSCSI %s LUN %d (%s, %s) has WWID %q but the volume expects %q; refusing to use it: %w",
			v.IQN, v.LUN, dev.Path, hctl, dev.ID.WWID, v.WWID, errdefs.ErrFailedPrecondition)
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

// login has iscsiadm create the node record for exactly this target and
// portal (`-o new`: it copies iscsid.conf's node.* settings into it), writes
// its settings and credentials into it in place, and logs in.
func (t *Transport) login(ctx context.Context, v *Volume, p path) (retErr error) {
	start := time.Now()
	if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsNodeNew(v.IQN, p.IP, p.Port, p.TPGT, v.Iface)...); err != nil {
		return t.iscsiadmError("create node record", err)
	}
	defer func() {
		logctx.From(ctx, t.log).Debug("iSCSI login", "portal", p.String(), "duration", time.Since(start), "error", retErr)
	}()
	defer func() {
		if retErr != nil {
			// Leave no record (and no credentials) behind for a login
			// that did not happen.
			if _, err := t.run.run(context.WithoutCancel(ctx), t.opts.Iscsiadm, argsNodeDelete(v.IQN, p.IP, p.Port, v.Iface)...); err != nil && command.ExitCode(err) != ISCSI_ERR_NO_OBJS_FOUND {
				logctx.From(ctx, t.log).Warn("delete node record after failed login", "target", v, "portal", p.String(), "error", err)
			}
		}
	}()
	files, err := t.db.nodeRecordFiles(v.IQN, p.IP, p.Port, v.Iface)
	if err != nil {
		return fmt.Errorf("iscsiadm created the node record of %s at %s, but berth cannot find it (name open-iscsi's record directory with --iscsi-node-dir): %w", v.IQN, p, err)
	}
	if err := t.db.update(ctx, files, t.recordSettings(v)); err != nil {
		return err
	}
	failpoint.Hit("iscsi.record_written")
	_, err = t.run.run(ctx, t.opts.Iscsiadm, argsNodeLogin(v.IQN, p.IP, p.Port, p.TPGT, v.Iface)...)
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
		return errdefs.Unavailable("%s: %s not found: install open-iscsi or set --iscsiadm", op, t.opts.Iscsiadm)
	}
	return fmt.Errorf("%s: %w", op, err)
}
