package target

import (
	"net"
	"os/exec"
	"sync"
	"testing"
)

var aliasMu sync.Mutex

// ensureLoopbackAlias adds host to lo when it is a 127/8 address the guest
// does not have yet, so targets can listen on 127.0.0.2, 127.0.0.3... and an
// initiator sees distinct paths.
func ensureLoopbackAlias(t testing.TB, host string) {
	t.Helper()
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() || ip.To4() == nil {
		return
	}
	aliasMu.Lock()
	defer aliasMu.Unlock()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) && ones(n) == 32 {
			return
		}
	}
	if out, err := exec.Command("ip", "addr", "add", host+"/32", "dev", "lo").CombinedOutput(); err != nil {
		t.Fatalf("ip addr add %s/32 dev lo: %v: %s", host, err, out)
	}
}

func ones(n *net.IPNet) int { o, _ := n.Mask.Size(); return o }

var blackHoleMu sync.Mutex

// BlackHole returns an address whose packets vanish: a /24 routed into a
// dummy interface (which drops everything it is given and has no ARP), so
// that a connect to it sees no SYN-ACK and no RST, as a portal behind a
// firewall that drops packets or a dead switch port does. One per guest;
// the interface stays until the guest ends.
func BlackHole(t testing.TB) string {
	t.Helper()
	blackHoleMu.Lock()
	defer blackHoleMu.Unlock()
	const dev, cidr, addr = "blackhole0", "10.254.254.1/24", "10.254.254.2"
	if _, err := net.InterfaceByName(dev); err == nil {
		return addr
	}
	LoadModules(t, "dummy")
	for _, args := range [][]string{
		{"link", "add", dev, "type", "dummy"},
		{"addr", "add", cidr, "dev", dev},
		{"link", "set", dev, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	return addr
}

// SilentListener accepts TCP connections on addr and never answers nor
// closes them until the test ends: a portal that completes the handshake
// and then says nothing, as a hung target or a firewall that drops all
// but the SYN-ACK looks to an initiator (its login or ICReq waits for its
// timeout).
func SilentListener(t testing.TB, addr string) {
	t.Helper()
	host, _, _ := net.SplitHostPort(addr)
	ensureLoopbackAlias(t, host)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
}
