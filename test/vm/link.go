package vm

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
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
