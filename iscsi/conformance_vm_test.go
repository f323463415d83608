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

// conformancePortals are the portals of the suite's targets.
var conformancePortals = []string{"127.0.0.1:3260", "127.0.0.2:3260"}

var conformanceSeq atomic.Int32

// TestGuestISCSIConformance runs the transport conformance suite on LUNs
// of LIO targets on loopback, logged in through one portal (the other
// is another name of each), without multipath.
func TestGuestISCSIConformance(t *testing.T) {
	conformance.Run(t, conformanceHarness(t, guestTransport(t, Options{}), false))
}

// TestMultipathConformanceISCSI runs the suite on dm-multipath maps over
// sessions through both portals of each target. Each map takes seconds
// to set up in a guest without KVM (two minutes for the suite), so
// TestVMISCSIMultipath runs it only when asked:
//
//	BERTH_ISCSI_RUN='^TestMultipathConformanceISCSI$' go test -count=1 -run '^TestVMISCSIMultipath$' ./iscsi/
func TestMultipathConformanceISCSI(t *testing.T) {
	startMultipathd(t)
	conformance.Run(t, conformanceHarness(t, guestTransport(t, Options{}), true))
}

func conformanceHarness(t *testing.T, tr *Transport, multipath bool) conformance.Harness {
	// newTarget makes a target with n LUNs of size bytes and returns a
	// volume of each.
	newTarget := func(t *testing.T, n int, size int64) []*conformance.Volume {
		iqn := fmt.Sprintf("iqn.2026-01.io.berth:conformance-%d", conformanceSeq.Add(1))
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
			vc := map[string]string{"transport": Name, KeyIQN: iqn, KeyLUN: strconv.Itoa(i)}
			alias := maps.Clone(vc)
			if multipath {
				vc[KeyPortals] = conformancePortals[0] + "," + conformancePortals[1]
				vc[KeyMultipath] = "true"
				alias[KeyTargetPortal] = conformancePortals[1]
			} else {
				vc[KeyTargetPortal] = conformancePortals[0]
				alias[KeyTargetPortal] = conformancePortals[1]
			}
			vols = append(vols, &conformance.Volume{
				Context: vc,
				Alias:   alias,
				Grow:    func(t *testing.T, size int64) { tgt.Grow(i, size) },
				Vanish:  vanish,
			})
		}
		return vols
	}
	paths := 1
	if multipath {
		paths = len(conformancePortals)
	}
	return conformance.Harness{
		Transport: agent.TransportFunc(agent.TransportKind{Name: Name, Keys: TransportKeys()}, tr.Parse),
		NewVolume: func(t *testing.T, size int64) *conformance.Volume { return newTarget(t, 1, size)[0] },
		NewSharedPair: func(t *testing.T, size int64) (a, b *conformance.Volume) {
			vols := newTarget(t, 2, size)
			return vols[0], vols[1]
		},
		Paths: paths,
	}
}
