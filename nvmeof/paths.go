package nvmeof

import (
	"context"
	"slices"
)

// PathStatus is the state of one path of a volume.
type PathStatus struct {
	Path       string // "tcp:10.0.0.5:4420"; "" for a path the volume did not ask for
	Controller string // "nvme3", "" when no controller exists
	State      string // controller state: live, connecting, resetting, ...
	// Device is the path's namespace device (nvme0c3n1, or the
	// namespace itself without multipath); "" when the namespace is not
	// visible through this controller.
	Device   string
	ANAState string // optimized, non-optimized, inaccessible, ...; "" without ANA
	// DHCHAP: the controller was connected with a DH-HMAC-CHAP key, so
	// every reconnect authenticates again with that key.
	DHCHAP bool
}

// Healthy reports whether I/O can use this path.
func (s PathStatus) Healthy() bool {
	return s.State == StateLive && s.Device != "" &&
		(s.ANAState == "" || s.ANAState == "optimized" || s.ANAState == "non-optimized")
}

func (s PathStatus) String() string {
	p := s.Path
	if p == "" {
		p = "extra path"
	}
	if s.Controller == "" {
		return p + ": no controller"
	}
	st := p + " (" + s.Controller + "): " + s.State
	if s.Device == "" {
		st += ", namespace not visible"
	}
	if s.ANAState != "" {
		st += ", " + s.ANAState
	}
	if s.DHCHAP && s.State != StateLive {
		// The kernel does not say why a reconnect failed (dmesg
		// aside); with authentication a changed key is one reason.
		st += " (connected with DH-HMAC-CHAP: reconnects fail while the target's key for this host differs from the key the controller was connected with; if the key was changed on the target, unstage every volume of the subsystem on this node and stage with the new key)"
	}
	return st
}

// Status returns the namespace device name and the state of every path
// the volume asked for, plus any other path of the namespace.
func (tg *Target) Status(ctx context.Context) (head string, paths []PathStatus, err error) {
	t := tg.t
	h, ok, err := tg.head()
	if err != nil {
		return "", nil, err
	}
	ctrls, err := t.sys.readControllers(tg.vol.NQN)
	if err != nil {
		return "", nil, err
	}
	nsPath := make(map[string]NamespacePath) // by controller
	var nsPaths []NamespacePath
	if ok {
		head = h.Name
		if nsPaths, err = t.sys.readNamespacePaths(h.Name); err != nil {
			return "", nil, err
		}
		for _, p := range nsPaths {
			nsPath[p.Controller] = p
		}
	}
	hostNQN := t.knownHostNQN()
	seen := make(map[string]bool)
	for _, p := range tg.vol.Paths {
		st := PathStatus{Path: p.String()}
		if rp, err := tg.resolve(ctx, p); err == nil {
			for i := range ctrls {
				if c := &ctrls[i]; c.matches(tg.vol.NQN, hostNQN, rp) {
					np := nsPath[c.Name]
					st.Controller, st.State, st.Device, st.ANAState = c.Name, c.State, np.Name, np.ANAState
					if ca, err := t.sys.readCtrlAuth(c.Name); err == nil {
						st.DHCHAP = ca.host != ""
					}
					seen[c.Name] = true
					break
				}
			}
		}
		paths = append(paths, st)
	}
	for _, p := range nsPaths {
		if seen[p.Controller] {
			continue
		}
		st := PathStatus{Controller: p.Controller, Device: p.Name, ANAState: p.ANAState}
		if i := slices.IndexFunc(ctrls, func(c Controller) bool { return c.Name == p.Controller }); i >= 0 {
			st.State = ctrls[i].State
		}
		paths = append(paths, st)
	}
	return head, paths, nil
}

// PathStates counts the paths the volume asked for by state, for
// metrics: the controller state ("live", "connecting", "resetting", ...),
// "missing" for a path without a controller, "no-namespace" for a live
// controller that does not show the namespace, and for a live path whose
// ANA group is not usable its ANA state ("inaccessible", ...).
func (tg *Target) PathStates(ctx context.Context) (map[string]int, error) {
	_, paths, err := tg.Status(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int)
	for _, p := range paths {
		switch {
		case p.Path == "":
			continue
		case p.Controller == "":
			out["missing"]++
		case p.State == StateLive && p.Device == "":
			out["no-namespace"]++
		case p.State == StateLive && !p.Healthy():
			out[p.ANAState]++
		default:
			out[p.State]++
		}
	}
	return out, nil
}
