package iscsi

import (
	"fmt"
	"maps"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/test/conformance"
	vmtarget "github.com/berth-csi/berth/test/vm/target"
)

// conformancePortals are the portals of the suite's targets: volumes log
// in through the first; the second is another name of each.
var conformancePortals = []string{"127.0.0.1:3260", "127.0.0.2:3260"}

// TestGuestISCSIConformance runs the transport conformance suite on LUNs
// of LIO targets on loopback, one session each, without multipath.
func TestGuestISCSIConformance(t *testing.T) {
	tr := guestTransport(t, Options{})
	var seq atomic.Int32
	// newTarget makes a target with n LUNs of size bytes and returns a
	// volume of each.
	newTarget := func(t *testing.T, n int, size int64) []*conformance.Volume {
		iqn := fmt.Sprintf("iqn.2026-01.io.berth:conformance-%d", seq.Add(1))
		luns := make([]vmtarget.ISCSILUN, n)
		for i := range luns {
			luns[i].Size = size
		}
		tgt := vmtarget.NewISCSITarget(t, vmtarget.ISCSIConfig{IQN: iqn, Portals: conformancePortals, LUNs: luns})
		vanish := func(t *testing.T) {
			for _, p := range conformancePortals {
				tgt.RemovePortal(p)
			}
		}
		var vols []*conformance.Volume
		for i := range luns {
			vc := map[string]string{"transport": Name, KeyIQN: iqn, KeyLUN: strconv.Itoa(i), KeyTargetPortal: conformancePortals[0]}
			alias := maps.Clone(vc)
			alias[KeyTargetPortal] = conformancePortals[1]
			vols = append(vols, &conformance.Volume{
				Context: vc,
				Alias:   alias,
				Grow:    func(t *testing.T, size int64) { tgt.Grow(i, size) },
				Vanish:  vanish,
			})
		}
		return vols
	}
	conformance.Run(t, conformance.Harness{
		Transport: agent.TransportFunc(agent.TransportKind{Name: Name, Keys: TransportKeys()}, tr.Parse),
		NewVolume: func(t *testing.T, size int64) *conformance.Volume { return newTarget(t, 1, size)[0] },
		NewSharedPair: func(t *testing.T, size int64) (a, b *conformance.Volume) {
			vols := newTarget(t, 2, size)
			return vols[0], vols[1]
		},
		Paths: 1,
	})
}
