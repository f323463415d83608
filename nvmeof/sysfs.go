package nvmeof

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/berth-csi/berth/internal/sysfs"
)

// Controller states as /sys/class/nvme/nvmeN/state prints them.
const (
	StateNew        = "new"
	StateLive       = "live"
	StateResetting  = "resetting"
	StateConnecting = "connecting"
	StateDeleting   = "deleting"
	StateDeletingIO = "deleting (no IO)"
	StateDead       = "dead"
)

// Address is a parsed /sys/class/nvme/nvmeN/address, for example
//
//	traddr=10.0.0.5,trsvcid=4420,host_traddr=10.0.0.9,src_addr=10.0.0.9
type Address struct {
	TrAddr     string
	TrSvcID    string
	HostTrAddr string
	HostIface  string
	SrcAddr    string // local address of the admin queue socket, when connected
}

// ParseAddress parses the address attribute of a fabrics controller.
// Unknown keys are ignored so that newer kernels keep working.
func ParseAddress(b []byte) (Address, error) {
	var a Address
	s := strings.TrimSpace(string(b))
	if s == "" {
		return a, errors.New("parse controller address: empty")
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return a, fmt.Errorf("parse controller address %q: %q is not key=value", s, kv)
		}
		switch k {
		case "traddr":
			a.TrAddr = v
		case "trsvcid":
			a.TrSvcID = v
		case "host_traddr":
			a.HostTrAddr = v
		case "host_iface":
			a.HostIface = v
		case "src_addr":
			a.SrcAddr = v
		}
	}
	if a.TrAddr == "" {
		return a, fmt.Errorf("parse controller address %q: no traddr", s)
	}
	return a, nil
}

// Controller is what sysfs tells about one NVMe controller.
type Controller struct {
	Name      string // "nvme3"
	Transport string // "tcp", "rdma", "pcie", "loop", ...
	SubsysNQN string
	State     string
	HostNQN   string // empty for PCIe controllers
	HostID    string
	Address   Address // zero for PCIe controllers
	// Paths are the per-controller namespace devices (nvme0c3n1) that
	// native multipath puts under the subsystem's head devices.
	Paths []string
}

// Deleting reports whether the controller is going away and must not be
// reused.
func (c *Controller) Deleting() bool {
	switch c.State {
	case StateDeleting, StateDeletingIO, StateDead:
		return true
	}
	return false
}

// same reports whether c and d, read at different times, describe one
// controller: same subsystem, host and address. The local address of its
// socket is left out, as it changes when the controller reconnects.
func (c *Controller) same(d *Controller) bool {
	a, b := c.Address, d.Address
	a.SrcAddr, b.SrcAddr = "", ""
	return c.SubsysNQN == d.SubsysNQN && c.Transport == d.Transport && c.HostNQN == d.HostNQN && a == b
}

// teardown orders this process's reads of a subsystem's controller
// addresses after its deletes of that subsystem's controllers (see
// readController): reads share a subsystem's lock, a delete holds it
// alone. It is one per process, as the kernel is.
var teardown subsysLocks

// subsysLocks is a read-write lock per subsystem NQN. The zero value is
// ready to use; subsystems nobody holds take no memory.
type subsysLocks struct {
	mu sync.Mutex
	m  map[string]*subsysLock
}

type subsysLock struct {
	sync.RWMutex
	refs int
}

func (l *subsysLocks) get(nqn string) *subsysLock {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = make(map[string]*subsysLock)
	}
	s := l.m[nqn]
	if s == nil {
		s = new(subsysLock)
		l.m[nqn] = s
	}
	s.refs++
	return s
}

func (l *subsysLocks) put(nqn string, s *subsysLock) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s.refs--; s.refs == 0 {
		delete(l.m, nqn)
	}
}

// rlock shares nqn's lock and returns the function that releases it.
func (l *subsysLocks) rlock(nqn string) func() {
	s := l.get(nqn)
	s.RLock()
	return func() { s.RUnlock(); l.put(nqn, s) }
}

// lock holds nqn's lock alone and returns the function that releases it.
func (l *subsysLocks) lock(nqn string) func() {
	s := l.get(nqn)
	s.Lock()
	return func() { s.Unlock(); l.put(nqn, s) }
}

var ctrlNameRE = regexp.MustCompile(`^nvme[0-9]+$`)

// pathNameRE matches a multipath path device: nvme<subsys>c<ctrl>n<ns>.
var pathNameRE = regexp.MustCompile(`^nvme([0-9]+)c([0-9]+)n([0-9]+)$`)

// headNameRE matches a namespace head (or non-multipath namespace) device.
var headNameRE = regexp.MustCompile(`^nvme([0-9]+)n([0-9]+)$`)

// sysTree reads the kernel's NVMe objects in a sysfs tree.
type sysTree struct {
	root sysfs.Root
	// readFile reads an attribute; nil is sysfs.ReadFile (tests give errors
	// only the kernel gives).
	readFile func(name string) ([]byte, error)
}

func (s sysTree) readAttr(dir, name string) (string, error) {
	read := s.readFile
	if read == nil {
		read = sysfs.ReadFile
	}
	b, err := read(filepath.Join(dir, name))
	if err != nil {
		return "", err
	}
	return sysfs.Value(b), nil
}

// readControllers lists every controller under class/nvme of the tree, with
// the address of those of subsystem nqn only (see readController). A
// controller that disappears while it is read is left out (its files are
// gone, or the kernel tore it down already and its attributes answer
// ENODEV); a missing class directory (nvme-core not loaded) is an empty
// list.
func (s sysTree) readControllers(nqn string) ([]Controller, error) {
	names, err := s.root.List("class", "nvme")
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list NVMe controllers: %w", err)
	}
	var out []Controller
	for _, name := range names {
		if !ctrlNameRE.MatchString(name) {
			continue
		}
		c, err := s.readController(s.root.Path("class", "nvme", name), nqn)
		if sysfs.Gone(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Controller) int { return ctrlNum(a.Name) - ctrlNum(b.Name) })
	return out, nil
}

func ctrlNum(name string) int {
	n, _ := strconv.Atoi(strings.TrimPrefix(name, "nvme"))
	return n
}

// readController reads the controller whose sysfs directory is dir. Its
// address is read only when it is a controller of subsystem nqn that the
// kernel does not report going away, and never while this process
// deletes a controller of that subsystem: a read of a TCP controller's
// address asks the controller's socket for its local address, and Debian
// 12's kernel (6.1) lets a delete release that socket under the reader.
// The reading thread then dies in the kernel holding the queue's lock,
// and every later delete of the controller hangs (measured in the guest:
// a loop reading every controller's address beside connects and deletes
// of one subsystem oopsed within 20 s; the same loop beside 8 losses and
// returns of a target, reading reconnecting controllers 64,405 times, did
// not). An empty nqn reads no address.
func (s sysTree) readController(dir, nqn string) (Controller, error) {
	c := Controller{Name: filepath.Base(dir)}
	var err error
	if c.Transport, err = s.readAttr(dir, "transport"); err != nil {
		return c, fmt.Errorf("read controller %s: %w", c.Name, err)
	}
	if c.SubsysNQN, err = s.readAttr(dir, "subsysnqn"); err != nil {
		return c, fmt.Errorf("read controller %s: %w", c.Name, err)
	}
	if c.State, err = s.readAttr(dir, "state"); err != nil {
		return c, fmt.Errorf("read controller %s: %w", c.Name, err)
	}
	// hostnqn, hostid and address exist for fabrics controllers only.
	if c.HostNQN, err = s.readAttr(dir, "hostnqn"); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return c, fmt.Errorf("read controller %s: %w", c.Name, err)
	}
	if c.HostID, err = s.readAttr(dir, "hostid"); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return c, fmt.Errorf("read controller %s: %w", c.Name, err)
	}
	if c.Transport != "pcie" && nqn != "" && c.SubsysNQN == nqn && !c.Deleting() {
		unlock := teardown.rlock(nqn)
		a, err := s.readAttr(dir, "address")
		unlock()
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return c, fmt.Errorf("read controller %s: %w", c.Name, err)
		case a != "":
			// The kernel prints an empty address while a controller is
			// being set up; such a controller matches nothing yet.
			if c.Address, err = ParseAddress([]byte(a)); err != nil {
				return c, fmt.Errorf("read controller %s: %w", c.Name, err)
			}
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return c, fmt.Errorf("read controller %s: %w", c.Name, err)
	}
	for _, e := range ents {
		if pathNameRE.MatchString(e.Name()) || headNameRE.MatchString(e.Name()) {
			c.Paths = append(c.Paths, e.Name())
		}
	}
	return c, nil
}

// Path is one way to a target: a transport address and port.
type Path struct {
	TrType     string
	TrAddr     string // an IP address, or a host name resolved at attach time
	TrSvcID    string
	HostTrAddr string
	HostIface  string
}

func (p Path) String() string {
	a := p.TrAddr
	if strings.Contains(a, ":") {
		a = "[" + a + "]"
	}
	return p.TrType + ":" + a + ":" + p.TrSvcID
}

// sameIP compares two address strings as IP addresses, so that the
// kernel's spelling ("::1") and ours ("0::1") agree.
func sameIP(a, b string) bool {
	if a == b {
		return true
	}
	x, err1 := netip.ParseAddr(a)
	y, err2 := netip.ParseAddr(b)
	return err1 == nil && err2 == nil && x == y
}

func samePort(a, b string) bool {
	if a == "" {
		a = DefaultPort
	}
	if b == "" {
		b = DefaultPort
	}
	x, err1 := strconv.Atoi(a)
	y, err2 := strconv.Atoi(b)
	return err1 == nil && err2 == nil && x == y
}

// matches reports whether the controller c is a connection to subsystem
// nqn through path p for host hostNQN, the same test the kernel makes
// before it refuses a duplicate connect: host_traddr and host_iface must
// be both unset or both equal. Deleting controllers never match.
func (c *Controller) matches(nqn, hostNQN string, p Path) bool {
	if c.Deleting() || c.SubsysNQN != nqn || c.Transport != p.TrType {
		return false
	}
	if hostNQN != "" && c.HostNQN != hostNQN {
		return false
	}
	if !sameIP(c.Address.TrAddr, p.TrAddr) || !samePort(c.Address.TrSvcID, p.TrSvcID) {
		return false
	}
	if (c.Address.HostTrAddr == "") != (p.HostTrAddr == "") ||
		(p.HostTrAddr != "" && !sameIP(c.Address.HostTrAddr, p.HostTrAddr)) {
		return false
	}
	return c.Address.HostIface == p.HostIface
}

// NamespacePath is one path of a multipath namespace.
type NamespacePath struct {
	Name       string // "nvme0c3n1"
	Controller string // "nvme3"
	ANAState   string // "optimized", "non-optimized", "inaccessible", ... or "" without ANA
}

// readNamespacePaths lists the paths of a namespace head device
// nvme<S>n<N>: the hidden per-controller devices nvme<S>c<C>n<N>, whose
// controller is nvme<C>. Kernels since 6.14 also link them from
// block/<head>/multipath; older ones only list them in
// block. A namespace without native multipath is its own single
// path, and its controller is its "device" link.
func (s sysTree) readNamespacePaths(head string) ([]NamespacePath, error) {
	m := headNameRE.FindStringSubmatch(head)
	if m == nil {
		return nil, fmt.Errorf("read paths of %s: not an NVMe namespace name", head)
	}
	if _, err := os.Stat(s.root.Path("block", head)); err != nil {
		return nil, fmt.Errorf("read paths of %s: %w", head, err)
	}
	var names []string
	all, err := s.root.List("block", head, "multipath")
	if errors.Is(err, fs.ErrNotExist) {
		all, err = s.root.List("block")
	}
	if err != nil {
		return nil, fmt.Errorf("read paths of %s: %w", head, err)
	}
	for _, name := range all {
		if pm := pathNameRE.FindStringSubmatch(name); pm != nil && pm[1] == m[1] && pm[3] == m[2] {
			names = append(names, name)
		}
	}
	var out []NamespacePath
	for _, name := range names {
		pm := pathNameRE.FindStringSubmatch(name)
		p := NamespacePath{Name: name, Controller: "nvme" + pm[2]}
		s, err := s.readAttr(s.root.Path("block", name), "ana_state")
		if err != nil && !sysfs.Gone(err) {
			return nil, fmt.Errorf("read ANA state of %s: %w", name, err)
		}
		p.ANAState = s
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b NamespacePath) int { return strings.Compare(a.Name, b.Name) })
	if len(out) > 0 {
		return out, nil
	}
	link, err := s.root.Readlink("block", head, "device")
	if err != nil {
		return nil, fmt.Errorf("read paths of %s: %w", head, err)
	}
	if c := filepath.Base(link); ctrlNameRE.MatchString(c) {
		return []NamespacePath{{Name: head, Controller: c}}, nil
	}
	return nil, nil // a head whose paths are all gone
}
