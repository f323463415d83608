package vm

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

// The guest that joins a link waits for the other's listener, and only
// for it: a port nothing listens on times out, and the wait makes no
// connection (the listening QEMU takes the first one as its peer).
func TestLinkWaitListening(t *testing.T) {
	if InGuest() {
		t.Skip("host test")
	}
	l := NewLink(t)
	if err := l.waitListening(100 * time.Millisecond); err == nil || !strings.Contains(err.Error(), "no guest listens") {
		t.Fatalf("waitListening with no listener: %v", err)
	}
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", l.port))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{})
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
			close(accepted)
		}
	}()
	if err := l.waitListening(5 * time.Second); err != nil {
		t.Fatalf("waitListening with a listener: %v", err)
	}
	select {
	case <-accepted:
		t.Fatal("waitListening connected to the listener")
	case <-time.After(100 * time.Millisecond):
	}
}
