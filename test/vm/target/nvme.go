package target

import (
	"encoding/hex"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

const nvmetRoot = "/sys/kernel/config/nvmet"

// NVMeNamespace describes a namespace of an NVMe/TCP target. Zero fields get
// stable defaults derived from the subsystem NQN and the namespace ID.
type NVMeNamespace struct {
	ID    uint32 // namespace ID (default: position + 1)
	Size  int64  // bytes (default 64 MiB)
	UUID  string // device_uuid
	NGUID string // device_nguid (UUID-formatted, 16 bytes)
	// Reservations enables NVMe reservations on the namespace
	// (resv_enable, nvmet since Linux 6.13). nvmet tells registrants
	// apart by host ID: initiators that stand for two nodes need two
	// (hostid= and hostnqn= of the connect string).
	Reservations bool
}

// NVMeConfig describes an NVMe/TCP target (an nvmet subsystem and its ports).
type NVMeConfig struct {
	NQN          string          // default nqn.2014-08.io.berth:test-N
	Serial       string          // attr_serial (default derived from the NQN)
	AllowedHosts []string        // host NQNs; empty: any host may connect
	Namespaces   []NVMeNamespace // default: one of 64 MiB
	Ports        []string        // "ip:port"; default 127.0.0.1:4420
	// DHCHAP, when set, makes every allowed host authenticate with
	// DH-HMAC-CHAP (it needs AllowedHosts: nvmet authenticates only
	// the hosts it lists).
	DHCHAP *NVMeDHCHAP
	// TLS, when set, makes the Ports offer NVMe/TCP with TLS 1.3
	// (addr_tsas "tls1.3") with this addr_treq: "required" or "not
	// required" (then a host may connect without TLS too). The PSKs
	// are the target's tlshd's business: keys in the .nvme keyring
	// (InsertTLSKey), and tlshd running (StartTLSHD).
	TLS string
}

// NVMeDHCHAP is the in-band authentication of one allowed host: the
// attributes of nvmet's hosts/<hostnqn> directory.
type NVMeDHCHAP struct {
	Key     string // dhchap_key: the host's key, DHHC-1 form
	CtrlKey string // dhchap_ctrl_key: the controller's key (bidirectional); "" = none
	Hash    string // dhchap_hash; default "hmac(sha256)"
	DHGroup string // dhchap_dhgroup; default "null" (no Diffie-Hellman exchange)
}

// NVMeTarget is an nvmet subsystem exported over NVMe/TCP.
type NVMeTarget struct {
	t     testing.TB
	cfg   NVMeConfig
	dir   string
	ns    map[uint32]*nvmeNS
	mu    sync.Mutex
	ports map[string]bool // addresses this subsystem is linked to
}

type nvmeNS struct {
	NVMeNamespace
	b *backing
}

// nvmet ports are shared by the subsystems listening on the same address.
var (
	portMu   sync.Mutex
	portByAd = map[string]int{} // "ip:port" -> nvmet port ID
	portRefs = map[int]int{}
)

// NewNVMeTarget creates an NVMe/TCP target; it is removed when the test ends.
func NewNVMeTarget(t testing.TB, cfg NVMeConfig) *NVMeTarget {
	t.Helper()
	LoadModules(t, "nvmet", "nvmet_tcp", "nvme_tcp")
	if cfg.NQN == "" {
		cfg.NQN = fmt.Sprintf("nqn.2014-08.io.berth:test-%d", next("nvme"))
	}
	if cfg.Serial == "" {
		id := stableID("serial", cfg.NQN)
		cfg.Serial = hex.EncodeToString(id[:8])
	}
	if len(cfg.Namespaces) == 0 {
		cfg.Namespaces = []NVMeNamespace{{}}
	}
	if len(cfg.Ports) == 0 {
		cfg.Ports = []string{"127.0.0.1:4420"}
	}
	n := &NVMeTarget{
		t: t, cfg: cfg,
		dir:   filepath.Join(nvmetRoot, "subsystems", cfg.NQN),
		ns:    map[uint32]*nvmeNS{},
		ports: map[string]bool{},
	}
	mustMkdir(t, n.dir)
	t.Cleanup(n.remove)

	if cfg.DHCHAP != nil && len(cfg.AllowedHosts) == 0 {
		t.Fatalf("nvme target %s: DH-HMAC-CHAP needs AllowedHosts", cfg.NQN)
	}
	if len(cfg.AllowedHosts) == 0 {
		mustWrite(t, filepath.Join(n.dir, "attr_allow_any_host"), "1")
	} else {
		mustWrite(t, filepath.Join(n.dir, "attr_allow_any_host"), "0")
		for _, h := range cfg.AllowedHosts {
			hd := filepath.Join(nvmetRoot, "hosts", h)
			if _, err := os.Stat(hd); os.IsNotExist(err) {
				mustMkdir(t, hd)
			}
			mustSymlink(t, hd, filepath.Join(n.dir, "allowed_hosts", h))
			if cfg.DHCHAP != nil {
				n.SetDHCHAP(h, *cfg.DHCHAP)
			}
		}
	}
	mustWrite(t, filepath.Join(n.dir, "attr_serial"), cfg.Serial)
	for i, ns := range cfg.Namespaces {
		if ns.ID == 0 {
			ns.ID = uint32(i + 1)
		}
		n.addNamespace(ns)
	}
	for _, p := range cfg.Ports {
		n.AddPortTLS(p, cfg.TLS)
	}
	return n
}

func (n *NVMeTarget) addNamespace(ns NVMeNamespace) {
	t := n.t
	t.Helper()
	if ns.Size == 0 {
		ns.Size = 64 << 20
	}
	if ns.UUID == "" {
		ns.UUID = formatUUID(stableID("uuid", n.cfg.NQN, strconv.Itoa(int(ns.ID))))
	}
	if ns.NGUID == "" {
		ns.NGUID = formatUUID(stableID("nguid", n.cfg.NQN, strconv.Itoa(int(ns.ID))))
	}
	b := newBacking(t, ns.Size)
	d := filepath.Join(n.dir, "namespaces", strconv.Itoa(int(ns.ID)))
	mustMkdir(t, d)
	mustWrite(t, filepath.Join(d, "device_path"), b.dev)
	mustWrite(t, filepath.Join(d, "device_uuid"), ns.UUID)
	mustWrite(t, filepath.Join(d, "device_nguid"), ns.NGUID)
	setReservations(t, d, ns.Reservations)
	mustWrite(t, filepath.Join(d, "enable"), "1")
	n.mu.Lock()
	n.ns[ns.ID] = &nvmeNS{NVMeNamespace: ns, b: b}
	n.mu.Unlock()
}

// setReservations writes the resv_enable attribute of the namespace
// directory d, which nvmet accepts only while the namespace is disabled
// (EINVAL once enabled, 7.3). Kernels before 6.13 have no such attribute:
// asking them for reservations fails the test; not asking writes nothing.
func setReservations(t testing.TB, d string, on bool) {
	t.Helper()
	p := filepath.Join(d, "resv_enable")
	if _, err := os.Stat(p); err != nil {
		if on {
			t.Fatalf("nvme target: namespace %s: no NVMe reservations in this kernel (nvmet has them since Linux 6.13; vm.WithKernel(\"trixie-backports\")): %v", d, err)
		}
		return
	}
	v := "0"
	if on {
		v = "1"
	}
	mustWrite(t, p, v)
}

// SetNamespaceEnabled disables or enables namespace nsid (its backing
// device and identity stay), as a target restart does between the two:
// the initiator is told the namespace changed and, when its rescan finds
// it disabled, removes its block device. nvmet keeps the namespace's
// reservations in memory only: a disabled namespace loses them (7.3).
func (n *NVMeTarget) SetNamespaceEnabled(nsid uint32, on bool) {
	t := n.t
	t.Helper()
	n.mu.Lock()
	ns, ok := n.ns[nsid]
	n.mu.Unlock()
	if !ok {
		t.Fatalf("nvme target %s: no namespace %d", n.cfg.NQN, nsid)
	}
	d := filepath.Join(n.dir, "namespaces", strconv.Itoa(int(nsid)))
	if !on {
		mustWrite(t, filepath.Join(d, "enable"), "0")
		return
	}
	setReservations(t, d, ns.Reservations)
	mustWrite(t, filepath.Join(d, "enable"), "1")
}

// SetDHCHAP sets the DH-HMAC-CHAP keys, hash and group host must use.
// Controllers connected already keep their session; the keys apply at
// the next (re)connect or re-authentication. An empty Key or CtrlKey
// clears that key: configfs refuses a write of zero bytes (EFAULT, on
// 6.12), so a lone NUL byte is written, which nvmet reads as the empty
// string that clears a key.
func (n *NVMeTarget) SetDHCHAP(host string, a NVMeDHCHAP) {
	t := n.t
	t.Helper()
	if a.Hash == "" {
		a.Hash = "hmac(sha256)"
	}
	if a.DHGroup == "" {
		a.DHGroup = "null"
	}
	hd := filepath.Join(nvmetRoot, "hosts", host)
	mustWrite(t, filepath.Join(hd, "dhchap_hash"), a.Hash)
	mustWrite(t, filepath.Join(hd, "dhchap_dhgroup"), a.DHGroup)
	mustWrite(t, filepath.Join(hd, "dhchap_key"), keyValue(a.Key))
	if a.CtrlKey != "" || hostAttr(hd, "dhchap_ctrl_key") != "" {
		mustWrite(t, filepath.Join(hd, "dhchap_ctrl_key"), keyValue(a.CtrlKey))
	}
}

// keyValue is what SetDHCHAP writes for key: the key, or a NUL byte
// that clears it.
func keyValue(key string) string {
	if key == "" {
		return "\x00"
	}
	return key
}

// hostAttr reads an attribute of an nvmet host ("" when unset or
// unreadable).
func hostAttr(dir, name string) string {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// NQN is the subsystem NQN.
func (n *NVMeTarget) NQN() string { return n.cfg.NQN }

// Serial is the controller serial number the initiator reads.
func (n *NVMeTarget) Serial() string { return n.cfg.Serial }

// Namespace returns the namespace nsid with its effective identity and size.
func (n *NVMeTarget) Namespace(nsid uint32) NVMeNamespace {
	n.mu.Lock()
	defer n.mu.Unlock()
	ns, ok := n.ns[nsid]
	if !ok {
		n.t.Fatalf("nvme target %s: no namespace %d", n.cfg.NQN, nsid)
	}
	return ns.NVMeNamespace
}

// BackingDevice is the loop device behind namespace nsid.
func (n *NVMeTarget) BackingDevice(nsid uint32) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ns[nsid].b.dev
}

// Ports lists the addresses the target listens on, sorted.
func (n *NVMeTarget) Ports() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Sorted(maps.Keys(n.ports))
}

// ConnectString is what an initiator writes to /dev/nvme-fabrics to reach
// the target through addr ("ip:port").
func (n *NVMeTarget) ConnectString(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		n.t.Fatalf("nvme target: address %q: %v", addr, err)
	}
	return fmt.Sprintf("transport=tcp,traddr=%s,trsvcid=%s,nqn=%s", host, port, n.cfg.NQN)
}

// AddPort makes the target listen on addr ("ip:port"; an address of the
// guest such as 127.0.0.1 or a loopback alias 127.0.0.2...).
func (n *NVMeTarget) AddPort(addr string) {
	n.t.Helper()
	n.AddPortTLS(addr, "")
}

// AddPortTLS is AddPort for a port with TLS: treq is its addr_treq
// ("required", "not required"), "" for a port without TLS. A port that
// exists already (shared with another subsystem) keeps its setting.
func (n *NVMeTarget) AddPortTLS(addr, treq string) {
	t := n.t
	t.Helper()
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("nvme target: port %q: %v", addr, err)
	}
	ensureLoopbackAlias(t, host)
	portMu.Lock()
	defer portMu.Unlock()
	id, ok := portByAd[addr]
	if !ok {
		id = 1
		for {
			if _, err := os.Stat(filepath.Join(nvmetRoot, "ports", strconv.Itoa(id))); os.IsNotExist(err) {
				break
			}
			id++
		}
		pd := filepath.Join(nvmetRoot, "ports", strconv.Itoa(id))
		mustMkdir(t, pd)
		mustWrite(t, filepath.Join(pd, "addr_trtype"), "tcp")
		mustWrite(t, filepath.Join(pd, "addr_adrfam"), "ipv4")
		mustWrite(t, filepath.Join(pd, "addr_traddr"), host)
		mustWrite(t, filepath.Join(pd, "addr_trsvcid"), port)
		if treq != "" {
			// addr_tsas first: it sets addr_treq to "required".
			mustWrite(t, filepath.Join(pd, "addr_tsas"), "tls1.3")
			mustWrite(t, filepath.Join(pd, "addr_treq"), treq)
		}
		portByAd[addr] = id
	}
	link := filepath.Join(nvmetRoot, "ports", strconv.Itoa(id), "subsystems", n.cfg.NQN)
	if err := os.Symlink(n.dir, link); err != nil {
		if !ok {
			os.Remove(filepath.Join(nvmetRoot, "ports", strconv.Itoa(id)))
			delete(portByAd, addr)
		}
		t.Fatalf("nvme target %s: listen on %s: %v", n.cfg.NQN, addr, err)
	}
	portRefs[id]++
	n.mu.Lock()
	n.ports[addr] = true
	n.mu.Unlock()
}

// RemovePort stops exporting the target on addr: the kernel drops the
// controllers connected through it (a path failure for the initiator).
func (n *NVMeTarget) RemovePort(addr string) {
	n.t.Helper()
	if err := n.removePort(addr); err != nil {
		n.t.Fatal(err)
	}
}

func (n *NVMeTarget) removePort(addr string) error {
	portMu.Lock()
	defer portMu.Unlock()
	n.mu.Lock()
	has := n.ports[addr]
	delete(n.ports, addr)
	n.mu.Unlock()
	if !has {
		return fmt.Errorf("nvme target %s: not listening on %s", n.cfg.NQN, addr)
	}
	id := portByAd[addr]
	pd := filepath.Join(nvmetRoot, "ports", strconv.Itoa(id))
	if err := os.Remove(filepath.Join(pd, "subsystems", n.cfg.NQN)); err != nil {
		return fmt.Errorf("nvme target %s: unlink port %s: %w", n.cfg.NQN, addr, err)
	}
	portRefs[id]--
	if portRefs[id] == 0 {
		delete(portRefs, id)
		delete(portByAd, addr)
		if err := os.Remove(pd); err != nil {
			return fmt.Errorf("nvme target: remove port %s: %w", addr, err)
		}
	}
	return nil
}

// ReplaceNamespace puts other storage behind namespace nsid, as an array
// does when a volume is deleted and its number reused: the namespace is
// disabled, given a new zeroed backing device of ns.Size bytes and the
// identity in ns (zero fields: new stable ones), and enabled again. The
// target announces the change; the initiator's rescan finds identifiers
// that differ from the ones it knew. It returns the new backing device.
func (n *NVMeTarget) ReplaceNamespace(nsid uint32, ns NVMeNamespace) string {
	t := n.t
	t.Helper()
	n.mu.Lock()
	old, ok := n.ns[nsid]
	n.mu.Unlock()
	if !ok {
		t.Fatalf("nvme target %s: no namespace %d", n.cfg.NQN, nsid)
	}
	gen := strconv.Itoa(next("replace"))
	ns.ID = nsid
	if ns.Size == 0 {
		ns.Size = old.Size
	}
	if ns.UUID == "" {
		ns.UUID = formatUUID(stableID("uuid", n.cfg.NQN, strconv.Itoa(int(nsid)), gen))
	}
	if ns.NGUID == "" {
		ns.NGUID = formatUUID(stableID("nguid", n.cfg.NQN, strconv.Itoa(int(nsid)), gen))
	}
	b := newBacking(t, ns.Size)
	d := filepath.Join(n.dir, "namespaces", strconv.Itoa(int(nsid)))
	mustWrite(t, filepath.Join(d, "enable"), "0")
	mustWrite(t, filepath.Join(d, "device_path"), b.dev)
	mustWrite(t, filepath.Join(d, "device_uuid"), ns.UUID)
	mustWrite(t, filepath.Join(d, "device_nguid"), ns.NGUID)
	setReservations(t, d, ns.Reservations)
	mustWrite(t, filepath.Join(d, "enable"), "1")
	n.mu.Lock()
	n.ns[nsid] = &nvmeNS{NVMeNamespace: ns, b: b}
	n.mu.Unlock()
	return b.dev
}

// Grow enlarges namespace nsid to size bytes and makes the target announce
// the new size (the initiator gets an asynchronous event).
func (n *NVMeTarget) Grow(nsid uint32, size int64) {
	t := n.t
	t.Helper()
	n.mu.Lock()
	ns, ok := n.ns[nsid]
	n.mu.Unlock()
	if !ok {
		t.Fatalf("nvme target %s: no namespace %d", n.cfg.NQN, nsid)
	}
	if err := ns.b.grow(size); err != nil {
		t.Fatalf("nvme target %s: grow namespace %d: %v", n.cfg.NQN, nsid, err)
	}
	mustWrite(t, filepath.Join(n.dir, "namespaces", strconv.Itoa(int(nsid)), "revalidate_size"), "1")
	n.mu.Lock()
	ns.Size = size
	n.mu.Unlock()
}

func (n *NVMeTarget) remove() {
	t := n.t
	for _, p := range n.Ports() {
		if err := n.removePort(p); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	}
	n.mu.Lock()
	ids := make([]uint32, 0, len(n.ns))
	for id := range n.ns {
		ids = append(ids, id)
	}
	n.mu.Unlock()
	for _, id := range ids {
		d := filepath.Join(n.dir, "namespaces", strconv.Itoa(int(id)))
		writeAttr(filepath.Join(d, "enable"), "0")
		rmdir(t, d)
	}
	unlinkAll(t, filepath.Join(n.dir, "allowed_hosts"))
	rmdir(t, n.dir)
	for _, h := range n.cfg.AllowedHosts {
		// Hosts may be shared with other subsystems: ignore EBUSY.
		// Keys stay with a host that another subsystem still links;
		// a removed host takes them along.
		os.Remove(filepath.Join(nvmetRoot, "hosts", h))
	}
}
