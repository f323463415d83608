package iscsi

import (
	"context"
	"strings"
)

// PathStates counts the volume's paths by state, one per portal: "live"
// for a logged-in session whose disk of the LUN is running; the session's
// state in lower case ("failed", "free") when it is not logged in;
// "no-lun" for a session without the LUN's disk; the SCSI device's state
// ("offline", "blocked") for a disk that does not run; "missing" for a
// portal with no session at all (a login that failed or never happened).
// It feeds the berth_volume_paths metric.
func (tg *Target) PathStates(ctx context.Context) (map[string]int, error) {
	t, v := tg.t, tg.v
	paths, _ := resolve(ctx, v.Portals)
	pds, err := t.findPaths(v, paths)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int)
	seen := make(map[string]bool)
	for _, pd := range pds {
		seen[pd.path.key(v.IQN, v.Iface)] = true
		switch {
		case pd.sess.State != "LOGGED_IN":
			out[strings.ToLower(pd.sess.State)]++
		case pd.dev == nil:
			out["no-lun"]++
		default:
			switch st := t.sys.SCSIDeviceState(pd.hctl); st {
			case "running":
				out["live"]++
			case "":
				out["no-lun"]++
			default:
				out[st]++
			}
		}
	}
	for _, p := range paths {
		if !seen[p.key(v.IQN, v.Iface)] {
			out["missing"]++
		}
	}
	if n := len(v.Portals) - len(paths); n > 0 {
		out["missing"] += n
	}
	return out, nil
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
