package vm

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// A Link is a private Ethernet segment between two guests: QEMU socket
// netdevs over host loopback (the first guest listens, the second connects).
// No packet leaves the host's loopback.
type Link struct {
	mu    sync.Mutex
	port  int
	users int
}

// NewLink reserves a loopback port for a link between two guests.
func NewLink(t testing.TB) *Link {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("vm: link port: %v", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return &Link{port: port}
}

func (l *Link) netdev() (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.users++
	switch l.users {
	case 1:
		return fmt.Sprintf("listen=127.0.0.1:%d", l.port), nil
	case 2:
		return fmt.Sprintf("connect=127.0.0.1:%d", l.port), nil
	}
	return "", errors.New("vm: a link joins two guests")
}

// linkWait bounds how long a guest that joins a link waits for the
// listening guest's QEMU to listen (normally well under a second).
const linkWait = 30 * time.Second

// waitListening waits until the link's port listens on host loopback, as
// /proc/net/tcp shows it: the connecting QEMU must not start before, and
// a probe connection would be taken for the peer (QEMU accepts one).
func (l *Link) waitListening(timeout time.Duration) error {
	want := fmt.Sprintf("0100007F:%04X", l.port)
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		ok, err := tcpListening(want)
		if err != nil || ok {
			return err
		}
		if time.Since(start) > timeout {
			return fmt.Errorf("link port 127.0.0.1:%d: no guest listens on it after %v", l.port, timeout)
		}
	}
}

// tcpListening reports whether /proc/net/tcp has a socket in state
// LISTEN (0A) at local address addr ("0100007F:1F90").
func tcpListening(addr string) (bool, error) {
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		return false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 3 && fields[1] == addr && fields[3] == "0A" {
			return true, nil
		}
	}
	return false, sc.Err()
}
