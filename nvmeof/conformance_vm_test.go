package nvmeof

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/test/conformance"
	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// conformancePorts are the ports of the suite's subsystems: volumes
// attach through the first; the second is another name of each.
var conformancePorts = []string{"127.0.0.1:4480", "127.0.0.1:4481"}

// TestGuestConformance runs the transport conformance suite on NVMe/TCP
// namespaces of nvmet subsystems on loopback, one path each. Staged
// lists every volume the suite made, as the agent's state would while
// they are staged.
func TestGuestConformance(t *testing.T) {
	vm.RequireGuest(t)
	var (
		mu     sync.Mutex
		staged []map[string]string
		seq    atomic.Int32
	)
	tr := guestTransport(t, func(context.Context) ([]map[string]string, error) {
		mu.Lock()
		defer mu.Unlock()
		return append([]map[string]string(nil), staged...), nil
	})
	// newTarget makes a subsystem with n namespaces of size bytes and
	// returns a volume of each.
	newTarget := func(t *testing.T, n int, size int64) []*conformance.Volume {
		nqn := fmt.Sprintf("nqn.2026-01.io.berth:conformance-%d", seq.Add(1))
		nss := make([]target.NVMeNamespace, n)
		for i := range nss {
			nss[i].Size = size
		}
		tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: conformancePorts, Namespaces: nss})
		vanish := func(t *testing.T) {
			for _, p := range conformancePorts {
				tgt.RemovePort(p)
			}
		}
		var vols []*conformance.Volume
		for i := range nss {
			nsid := uint32(i + 1)
			vc := map[string]string{"transport": Name, "nqn": nqn, "nsid": strconv.Itoa(int(nsid)), "traddr": "127.0.0.1", "trsvcid": "4480"}
			alias := maps.Clone(vc)
			alias["trsvcid"] = "4481"
			mu.Lock()
			staged = append(staged, vc)
			mu.Unlock()
			vols = append(vols, &conformance.Volume{
				Context: vc,
				Alias:   alias,
				Grow:    func(t *testing.T, size int64) { tgt.Grow(nsid, size) },
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
