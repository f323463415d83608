package devices

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// PathState is one path of a dm-multipath map.
type PathState struct {
	Name         string // kernel name of the path device, "sdb"
	Major, Minor uint32
	// Active is the map's view: false once the kernel failed the path.
	Active    bool
	FailCount int
	// Group is the 1-based priority group the path is in; GroupState is
	// "A" (active group), "E" (enabled) or "D" (disabled).
	Group      int
	GroupState string
	// SCSIState is the SCSI device state of the path ("running",
	// "offline", "transport-offline", "blocked"); "" for other devices.
	SCSIState string
}

// Working reports whether a path can carry I/O now: the map has not
// failed it and its SCSI device (if it is one) is running, not blocked
// by a session in recovery.
func (p PathState) Working() bool {
	return p.Active && (p.SCSIState == "" || p.SCSIState == "running")
}

// MultipathMap returns the dm-multipath map that holds the path device
// pathName, or an error wrapping errdefs.ErrNotFound when none does.
func (r Roots) MultipathMap(pathName string) (*Device, error) {
	holders, err := r.Holders(pathName)
	if err != nil {
		return nil, err
	}
	for _, h := range holders {
		d, err := r.Lookup(h)
		if err != nil {
			continue
		}
		if d.ID.Kind == KindDM && strings.HasPrefix(d.ID.WWID, multipathUUIDPrefix) {
			return d, nil
		}
	}
	return nil, fmt.Errorf("multipath map holding %s: %w", pathName, errdefs.ErrNotFound)
}

// multipathFeatures returns the feature arguments that open a dm
// "multipath" target's table line: "<#features> <feature>…", as in
// "1 queue_if_no_path 0 1 1 service-time 0 1 2 8:16 1 1". A line that
// does not start with a count has none.
func multipathFeatures(params string) []string {
	f := strings.Fields(params)
	if len(f) == 0 {
		return nil
	}
	n, err := strconv.Atoi(f[0])
	if err != nil || n < 0 || n > len(f)-1 {
		return nil
	}
	return f[1 : 1+n]
}

// mpathPath is a path as the multipath target's status line reports it.
type mpathPath struct {
	dev        string // "8:16"
	active     bool
	failCount  int
	group      int
	groupState string
}

// parseMultipathStatus parses the status line of a dm "multipath" target
// (STATUSTYPE_INFO, as DM_TABLE_STATUS or `dmsetup status` give it after the
// start, length and target type):
//
//	<#feature args> <args…> <#handler args> <args…> <#groups> <next group>
//	then per group: <state> <#selector args> <args…> <#paths> <#selector path args>
//	then per path:  <major:minor> <A|F> <fail count> <selector path args…>
func parseMultipathStatus(s string) ([]mpathPath, error) {
	f := strings.Fields(s)
	pos := 0
	next := func() (string, error) {
		if pos >= len(f) {
			return "", errors.New("status line ends early")
		}
		pos++
		return f[pos-1], nil
	}
	num := func() (int, error) {
		w, err := next()
		if err != nil {
			return 0, err
		}
		n, err := strconv.Atoi(w)
		if err != nil || n < 0 || n > 1<<16 {
			return 0, fmt.Errorf("word %d %q is not a count", pos, w)
		}
		return n, nil
	}
	skip := func() error { // a count followed by that many words
		n, err := num()
		if err != nil {
			return err
		}
		if pos+n > len(f) {
			return errors.New("status line ends early")
		}
		pos += n
		return nil
	}
	fail := func(err error) ([]mpathPath, error) {
		return nil, fmt.Errorf("multipath status %q: %w", s, err)
	}
	if err := skip(); err != nil { // features
		return fail(err)
	}
	if err := skip(); err != nil { // hardware handler
		return fail(err)
	}
	groups, err := num()
	if err != nil {
		return fail(err)
	}
	if _, err := num(); err != nil { // next group
		return fail(err)
	}
	var out []mpathPath
	for g := 1; g <= groups; g++ {
		state, err := next()
		if err != nil {
			return fail(err)
		}
		if state != "A" && state != "E" && state != "D" {
			return fail(fmt.Errorf("group %d state %q", g, state))
		}
		if err := skip(); err != nil { // selector status of the group
			return fail(err)
		}
		paths, err := num()
		if err != nil {
			return fail(err)
		}
		pathArgs, err := num()
		if err != nil {
			return fail(err)
		}
		for range paths {
			dev, err := next()
			if err != nil {
				return fail(err)
			}
			if _, _, err := parseMajorMinor(dev); err != nil {
				return fail(err)
			}
			st, err := next()
			if err != nil {
				return fail(err)
			}
			if st != "A" && st != "F" {
				return fail(fmt.Errorf("path %s state %q", dev, st))
			}
			fc, err := num()
			if err != nil {
				return fail(err)
			}
			if pos+pathArgs > len(f) {
				return fail(errors.New("status line ends early"))
			}
			pos += pathArgs
			out = append(out, mpathPath{dev: dev, active: st == "A", failCount: fc, group: g, groupState: state})
		}
	}
	if pos != len(f) {
		return fail(fmt.Errorf("%d words left over", len(f)-pos))
	}
	return out, nil
}
