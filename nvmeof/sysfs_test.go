package nvmeof

import (
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

func readSample(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseAddress(t *testing.T) {
	for _, tc := range []struct {
		sample string
		want   Address
	}{
		{"address-tcp-v4", Address{TrAddr: "127.0.0.1", TrSvcID: "4420", SrcAddr: "127.0.0.1"}},
		{"address-tcp-v6-host", Address{TrAddr: "fd00::5", TrSvcID: "4421", HostTrAddr: "fd00::9", HostIface: "eth1", SrcAddr: "fd00::9"}},
		{"address-tcp-connecting", Address{TrAddr: "10.0.0.5", TrSvcID: "4420"}},
		{"address-rdma", Address{TrAddr: "192.168.10.2", TrSvcID: "4420", HostTrAddr: "192.168.10.1"}},
	} {
		got, err := ParseAddress(readSample(t, tc.sample))
		if err != nil {
			t.Errorf("%s: %v", tc.sample, err)
			continue
		}
		if got != tc.want {
			t.Errorf("%s: got %+v, want %+v", tc.sample, got, tc.want)
		}
	}
	for _, bad := range []string{"", "\n", "traddr", "trsvcid=4420", "traddr=1.2.3.4,junk"} {
		if a, err := ParseAddress([]byte(bad)); err == nil {
			t.Errorf("ParseAddress(%q) = %+v, want an error", bad, a)
		}
	}
	// Keys a newer kernel may add are ignored.
	a, err := ParseAddress([]byte("traddr=1.2.3.4,trsvcid=4420,tls_key=0x1,src_addr=1.2.3.5\n"))
	if err != nil || a.TrAddr != "1.2.3.4" || a.SrcAddr != "1.2.3.5" {
		t.Errorf("unknown key: %+v, %v", a, err)
	}
}

const (
	subA   = "nqn.2026-01.io.berth:a"
	hostA  = "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e"
	hidA   = "0f8fad5b-d9cb-469f-a165-70867728950e"
	nguid1 = "00112233-4455-6677-8899-aabbccddeeff"
)

// sampleSys is a host with a PCIe disk (nvme0), two TCP paths to
// subsystem A (nvme1 live, nvme2 connecting) joined under head nvme1n1
// (namespace 1, subsystem instance 1) and a controller being deleted.
func sampleSys(t *testing.T) *sysfstest.Tree {
	sys := sysfstest.New(t)
	sys.Files(map[string]string{
		"class/nvme/nvme0/transport":    "pcie\n",
		"class/nvme/nvme0/subsysnqn":    "nqn.2014.08.org.nvmexpress:80868086PHM\n",
		"class/nvme/nvme0/state":        "live\n",
		"class/nvme/nvme0/nvme0n1/size": "100\n",

		"class/nvme/nvme1/transport":      "tcp\n",
		"class/nvme/nvme1/subsysnqn":      subA + "\n",
		"class/nvme/nvme1/state":          "live\n",
		"class/nvme/nvme1/hostnqn":        hostA + "\n",
		"class/nvme/nvme1/hostid":         hidA + "\n",
		"class/nvme/nvme1/address":        "traddr=127.0.0.1,trsvcid=4420,src_addr=127.0.0.1\n",
		"class/nvme/nvme1/nvme1c1n1/size": "2048\n",

		"class/nvme/nvme2/transport":      "tcp\n",
		"class/nvme/nvme2/subsysnqn":      subA + "\n",
		"class/nvme/nvme2/state":          "connecting\n",
		"class/nvme/nvme2/hostnqn":        hostA + "\n",
		"class/nvme/nvme2/hostid":         hidA + "\n",
		"class/nvme/nvme2/address":        "traddr=0::1,trsvcid=4421\n",
		"class/nvme/nvme2/nvme1c2n1/size": "2048\n",

		"class/nvme/nvme3/transport": "tcp\n",
		"class/nvme/nvme3/subsysnqn": subA + "\n",
		"class/nvme/nvme3/state":     "deleting\n",
		"class/nvme/nvme3/hostnqn":   hostA + "\n",
		"class/nvme/nvme3/hostid":    hidA + "\n",
		"class/nvme/nvme3/address":   "traddr=127.0.0.1,trsvcid=4422\n",

		"class/nvme/nvme-junk/transport": "tcp\n", // not a controller name

		"block/nvme1n1/nsid":                          "1\n",
		"block/nvme1n1/uuid":                          "6E4F2A2D-0C1B-4B8E-9C55-7E4D3F1A2B3C\n",
		"block/nvme1n1/nguid":                         nguid1 + "\n",
		"block/nvme1n1/size":                          "2048\n",
		"block/nvme1c1n1/ana_state":                   "optimized\n",
		"block/nvme1c1n1/size":                        "2048\n",
		"block/nvme1c1n1/nsid":                        "1\n",
		"block/nvme1c2n1/ana_state":                   "inaccessible\n",
		"block/nvme1n2/nsid":                          "2\n",
		"block/nvme1n2/uuid":                          "00000000-0000-0000-0000-000000000000\n",
		"block/nvme1n2/size":                          "4096\n",
		"block/nvme0n1/nsid":                          "1\n",
		"block/nvme0n1/size":                          "100\n",
		"block/loop0/size":                            "8\n",
		"class/nvme-subsystem/nvme-subsys1/subsysnqn": subA + "\n",
	})
	sys.Link("block/nvme1n1/device", "../../class/nvme-subsystem/nvme-subsys1")
	sys.Link("block/nvme1n1/multipath/nvme1c1n1", "../../nvme1c1n1")
	sys.Link("block/nvme1n1/multipath/nvme1c2n1", "../../nvme1c2n1")
	sys.Link("block/nvme1n2/device", "../../class/nvme-subsystem/nvme-subsys1")
	sys.Link("block/nvme0n1/device", "../../class/nvme/nvme0")
	return sys
}

func TestReadControllers(t *testing.T) {
	sys := sampleSys(t)
	cs, err := sysTree{root: sys.Root()}.readControllers(subA)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range cs {
		names = append(names, c.Name)
	}
	if want := []string{"nvme0", "nvme1", "nvme2", "nvme3"}; !reflect.DeepEqual(names, want) {
		t.Fatalf("controllers %v, want %v", names, want)
	}
	want1 := Controller{Name: "nvme1", Transport: "tcp", SubsysNQN: subA, State: "live", HostNQN: hostA, HostID: hidA,
		Address: Address{TrAddr: "127.0.0.1", TrSvcID: "4420", SrcAddr: "127.0.0.1"}, Paths: []string{"nvme1c1n1"}}
	if !reflect.DeepEqual(cs[1], want1) {
		t.Errorf("nvme1:\n got %+v\nwant %+v", cs[1], want1)
	}
	if cs[0].Transport != "pcie" || cs[0].HostNQN != "" || cs[0].Address != (Address{}) {
		t.Errorf("nvme0: %+v", cs[0])
	}
	if !cs[3].Deleting() || cs[1].Deleting() || cs[2].Deleting() {
		t.Errorf("Deleting: %v %v %v", cs[1].Deleting(), cs[2].Deleting(), cs[3].Deleting())
	}
	// A deleting controller's address is not read (see readController).
	if cs[2].Address.TrSvcID != "4421" || cs[3].Address != (Address{}) {
		t.Errorf("addresses of nvme2 %+v and nvme3 (deleting) %+v", cs[2].Address, cs[3].Address)
	}
	// Nor is any address of another subsystem.
	others, err := sysTree{root: sys.Root()}.readControllers("nqn.2026-01.io.berth:b")
	if err != nil || len(others) != 4 {
		t.Fatalf("readControllers for another subsystem: %v, %v", others, err)
	}
	for _, c := range others {
		if c.Address != (Address{}) || c.State == "" || c.SubsysNQN == "" {
			t.Errorf("%s read for another subsystem: %+v", c.Name, c)
		}
	}

	// Without nvme-core there is no class directory: no controllers.
	if cs, err := (sysTree{root: sysfstest.New(t).Root()}).readControllers(subA); err != nil || len(cs) != 0 {
		t.Errorf("empty sysfs: %v, %v", cs, err)
	}
}

func TestControllerMatches(t *testing.T) {
	cs, err := sysTree{root: sampleSys(t).Root()}.readControllers(subA)
	if err != nil {
		t.Fatal(err)
	}
	byName := func(n string) *Controller {
		for i := range cs {
			if cs[i].Name == n {
				return &cs[i]
			}
		}
		t.Fatalf("no %s", n)
		return nil
	}
	p := Path{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4420"}
	for _, tc := range []struct {
		ctrl, nqn, host string
		p               Path
		want            bool
	}{
		{"nvme1", subA, hostA, p, true},
		{"nvme1", subA, "", p, true},
		{"nvme1", subA, "nqn.2026-01.io.berth:otherhost", p, false},
		{"nvme1", "nqn.2026-01.io.berth:b", hostA, p, false},
		{"nvme1", subA, hostA, Path{TrType: "rdma", TrAddr: "127.0.0.1", TrSvcID: "4420"}, false},
		{"nvme1", subA, hostA, Path{TrType: "tcp", TrAddr: "127.0.0.2", TrSvcID: "4420"}, false},
		{"nvme1", subA, hostA, Path{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4421"}, false},
		{"nvme1", subA, hostA, Path{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4420", HostTrAddr: "127.0.0.1"}, false},
		{"nvme1", subA, hostA, Path{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4420", HostIface: "lo"}, false},
		{"nvme2", subA, hostA, Path{TrType: "tcp", TrAddr: "::1", TrSvcID: "4421"}, true},        // "0::1" in sysfs
		{"nvme3", subA, hostA, Path{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4422"}, false}, // deleting
		{"nvme0", "nqn.2014.08.org.nvmexpress:80868086PHM", "", p, false},
	} {
		if got := byName(tc.ctrl).matches(tc.nqn, tc.host, tc.p); got != tc.want {
			t.Errorf("%s.matches(%s, %q, %+v) = %v, want %v", tc.ctrl, tc.nqn, tc.host, tc.p, got, tc.want)
		}
	}
}

func TestReadHeadsAndPaths(t *testing.T) {
	sys := sampleSys(t)
	hs, err := sysTree{root: sys.Root()}.readHeads(subA)
	if err != nil {
		t.Fatal(err)
	}
	want := []Head{
		{Name: "nvme1n1", NQN: subA, NSID: 1, UUID: "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c", NGUID: nguid1, Size: 2048 * 512},
		{Name: "nvme1n2", NQN: subA, NSID: 2, Size: 4096 * 512},
	}
	if !reflect.DeepEqual(hs, want) {
		t.Fatalf("heads:\n got %+v\nwant %+v", hs, want)
	}
	all, err := sysTree{root: sys.Root()}.readHeads("")
	if err != nil || len(all) != 3 {
		t.Errorf("all heads: %+v, %v", all, err)
	}
	for _, tc := range []struct {
		v    Volume
		want bool
	}{
		{Volume{NQN: subA, NSID: 1}, true},
		{Volume{NQN: subA, UUID: "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c"}, true},
		{Volume{NQN: subA, NSID: 1, NGUID: nguid1}, true},
		{Volume{NQN: subA, NSID: 2}, false},
		{Volume{NQN: subA, NSID: 1, UUID: "6e4f2a2d-0c1b-4b8e-9c55-000000000000"}, false},
		{Volume{NQN: "nqn.2026-01.io.berth:b", NSID: 1}, false},
	} {
		if got := hs[0].matches(&tc.v); got != tc.want {
			t.Errorf("nvme1n1 matches %+v = %v, want %v", tc.v, got, tc.want)
		}
	}

	paths, err := sysTree{root: sys.Root()}.readNamespacePaths("nvme1n1")
	if err != nil {
		t.Fatal(err)
	}
	wantPaths := []NamespacePath{
		{Name: "nvme1c1n1", Controller: "nvme1", ANAState: "optimized"},
		{Name: "nvme1c2n1", Controller: "nvme2", ANAState: "inaccessible"},
	}
	if !reflect.DeepEqual(paths, wantPaths) {
		t.Errorf("paths:\n got %+v\nwant %+v", paths, wantPaths)
	}
	if _, err := (sysTree{root: sys.Root()}).readNamespacePaths("nvme9n9"); err == nil {
		t.Error("paths of a missing namespace: no error")
	}

	// Before Linux 6.14 there is no multipath directory: the hidden path
	// devices are found in /sys/block by name.
	sys.Remove("block/nvme1n1/multipath")
	paths, err = sysTree{root: sys.Root()}.readNamespacePaths("nvme1n1")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(paths, wantPaths) {
		t.Errorf("paths without multipath directory:\n got %+v\nwant %+v", paths, wantPaths)
	}
	// Without native multipath a namespace is its controller's device.
	paths, err = sysTree{root: sys.Root()}.readNamespacePaths("nvme0n1")
	if err != nil || !reflect.DeepEqual(paths, []NamespacePath{{Name: "nvme0n1", Controller: "nvme0"}}) {
		t.Errorf("non-multipath paths: %+v, %v", paths, err)
	}
}

func TestPathStatusHealthy(t *testing.T) {
	for _, tc := range []struct {
		s    PathStatus
		want bool
	}{
		{PathStatus{State: "live", Device: "nvme0c0n1", ANAState: "optimized"}, true},
		{PathStatus{State: "live", Device: "nvme0c0n1", ANAState: "non-optimized"}, true},
		{PathStatus{State: "live", Device: "nvme0n1"}, true},
		{PathStatus{State: "live", ANAState: "optimized"}, false}, // namespace not visible
		{PathStatus{State: "live", Device: "nvme0c0n1", ANAState: "inaccessible"}, false},
		{PathStatus{State: "connecting", Device: "nvme0c0n1", ANAState: "optimized"}, false},
		{PathStatus{}, false},
	} {
		if got := tc.s.Healthy(); got != tc.want {
			t.Errorf("%+v.Healthy() = %v", tc.s, got)
		}
	}
}

// A controller torn down while it is listed (another volume's detach,
// ctrl-loss-tmo) answers ENODEV from its attributes: it is left out, as
// one whose directory went away, and does not fail the listing.
func TestReadControllersSkipsControllerTornDown(t *testing.T) {
	sys := sampleSys(t)
	tree := sysTree{root: sys.Root(), readFile: func(name string) ([]byte, error) {
		if strings.HasSuffix(name, filepath.Join("nvme2", "address")) {
			return nil, &fs.PathError{Op: "read", Path: name, Err: syscall.ENODEV}
		}
		return os.ReadFile(name)
	}}
	cs, err := tree.readControllers(subA)
	if err != nil {
		t.Fatalf("readControllers: %v", err)
	}
	var names []string
	for _, c := range cs {
		names = append(names, c.Name)
	}
	if want := []string{"nvme0", "nvme1", "nvme3"}; !reflect.DeepEqual(names, want) {
		t.Fatalf("controllers %v, want %v", names, want)
	}
}

// TestReadHeadsSkipsNamespacesGoing: another subsystem's namespace that
// is torn down while the heads are listed answers ENODEV from its
// attributes; the listing leaves it out instead of failing the volume's
// RPC.
func TestReadHeadsSkipsNamespacesGoing(t *testing.T) {
	sys := sampleSys(t)
	sys.Files(map[string]string{
		"class/nvme-subsystem/nvme-subsys7/subsysnqn": "nqn.2026-01.io.berth:going\n",
		"block/nvme7n1/nsid":                          "1\n",
		"block/nvme7n1/size":                          "2048\n",
	})
	sys.Link("block/nvme7n1/device", "../../class/nvme-subsystem/nvme-subsys7")
	tree := sysTree{root: sys.Root(), readFile: func(p string) ([]byte, error) {
		if strings.Contains(p, "/nvme7n1/") {
			return nil, &fs.PathError{Op: "read", Path: p, Err: syscall.ENODEV}
		}
		return os.ReadFile(p)
	}}
	hs, err := tree.readHeads(subA)
	if err != nil {
		t.Fatalf("readHeads with another subsystem's namespace going: %v", err)
	}
	if len(hs) == 0 {
		t.Fatal("readHeads lost the subsystem's own namespaces")
	}
}

// TestAddressReadWaitsForDelete: this process never reads an address of
// a subsystem's controller while it deletes one of that subsystem's
// controllers, and reads of other subsystems go on meanwhile.
func TestAddressReadWaitsForDelete(t *testing.T) {
	sys := sampleSys(t)
	unlock := teardown.lock(subA)
	read := make(chan error, 1)
	go func() {
		_, err := sysTree{root: sys.Root()}.readControllers(subA)
		read <- err
	}()
	if _, err := (sysTree{root: sys.Root()}).readControllers("nqn.2026-01.io.berth:b"); err != nil {
		t.Fatalf("another subsystem's read during a delete: %v", err)
	}
	select {
	case err := <-read:
		t.Fatalf("an address of %s was read during a delete of its controller (%v)", subA, err)
	case <-time.After(50 * time.Millisecond):
	}
	unlock()
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	if len(teardown.m) != 0 {
		t.Errorf("locks left behind: %v", teardown.m)
	}
}
