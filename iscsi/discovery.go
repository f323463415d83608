package iscsi

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/logctx"
)

// discovered is one line of SendTargets output: "ip:port,tpgt target".
type discovered struct {
	IP     string
	Port   int
	TPGT   int
	Target string
}

// parseDiscovery reads iscsiadm's discovery output.
func parseDiscovery(out []byte) []discovered {
	var res []discovered
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		portal, tpgtS, ok := strings.Cut(f[0], ",")
		if !ok {
			continue
		}
		host, portS, err := net.SplitHostPort(portal)
		if err != nil {
			continue
		}
		port, err1 := strconv.Atoi(portS)
		tpgt, err2 := strconv.Atoi(tpgtS)
		if err1 != nil || err2 != nil {
			continue
		}
		res = append(res, discovered{IP: canonicalIP(host), Port: port, TPGT: tpgt, Target: strings.ToLower(f[1])})
	}
	return res
}

// discover runs SendTargets through the first portal, without storing the
// results as node records: berth creates records only for the portals the
// volume names. It checks that the target is offered and learns the portal
// group tags.
func (t *Transport) discover(ctx context.Context, v *Volume, paths []path) (retErr error) {
	p := paths[0]
	unlock, err := t.lockDiscovery(ctx, p)
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := t.run.run(ctx, t.opts.Iscsiadm, argsDiscoveryNew(p.IP, p.Port, v.Iface)...); err != nil {
		return t.iscsiadmError(fmt.Sprintf("create discovery record for %s", p), err)
	}
	defer func() {
		// The discovery record may hold credentials: it does not outlive
		// the discovery.
		if _, err := t.run.run(context.WithoutCancel(ctx), t.opts.Iscsiadm, argsDiscoveryDelete(p.IP, p.Port)...); err != nil && command.ExitCode(err) != ISCSI_ERR_NO_OBJS_FOUND {
			logctx.From(ctx, t.log).Warn("delete discovery record", "portal", p.String(), "error", err)
		}
	}()
	if c := v.DiscoveryCHAP; c != nil {
		dir, err := t.db.sendTargetsDir()
		if err != nil {
			return err
		}
		set := []setting{
			{"discovery.sendtargets.auth.authmethod", "CHAP"},
			{SecretDiscoveryUsername, c.Username},
			{SecretDiscoveryPassword, c.Password},
		}
		if c.Mutual() {
			set = append(set, setting{SecretDiscoveryUsernameIn, c.UsernameIn}, setting{SecretDiscoveryPasswordIn, c.PasswordIn})
		}
		file := filepath.Join(dir, p.IP+","+strconv.Itoa(p.Port), "st_config")
		if err := t.db.update(ctx, []string{file}, set); err != nil {
			return err
		}
	}
	out, err := t.run.run(ctx, t.opts.Iscsiadm, argsDiscover(p.IP, p.Port, v.Iface)...)
	if err != nil {
		return t.iscsiadmError(fmt.Sprintf("SendTargets discovery through %s", p), err)
	}
	if t.testHookDiscovered != nil {
		t.testHookDiscovered()
	}
	found := false
	for _, d := range parseDiscovery(out) {
		if d.Target != v.IQN {
			continue
		}
		found = true
		for i := range paths {
			if paths[i].TPGT < 0 && paths[i].IP == d.IP && paths[i].Port == d.Port {
				paths[i].TPGT = d.TPGT
			}
		}
	}
	if !found {
		return fmt.Errorf("SendTargets discovery through %s does not offer target %s to this initiator: check the target name and the target's ACLs: %w", p, v.IQN, errdefs.ErrNotFound)
	}
	return nil
}

// lockDiscovery makes the discoveries through p take turns, within berth
// and across the berths of the node: a portal's discovery record is the
// node's, and two discoveries at once would create, edit, use and delete
// the same record, one under the other.
func (t *Transport) lockDiscovery(ctx context.Context, p path) (unlock func(), err error) {
	portal := net.JoinHostPort(p.IP, strconv.Itoa(p.Port))
	held, err := t.locks.Hold(ctx, "sendtargets|"+portal)
	if err != nil {
		return nil, fmt.Errorf("wait for another discovery through %s: %w", portal, err)
	}
	if t.db.walks == nil {
		return held.Release, nil
	}
	l, err := t.db.walks.lockInContext(ctx, "berth.discovery."+p.IP+","+strconv.Itoa(p.Port))
	if err != nil {
		held.Release()
		return nil, fmt.Errorf("order the discoveries through %s: %w", portal, err)
	}
	return func() { l.Close(); held.Release() }, nil
}
