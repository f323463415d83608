package iscsi

import (
	"context"
	"fmt"
	"strings"
)

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
