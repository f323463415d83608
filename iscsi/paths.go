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
