package vm

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

// InGuest reports whether the process runs inside a berth test guest.
func InGuest() bool { return os.Getenv("BERTH_VM_GUEST") == "1" }

// RequireGuest skips t unless it runs inside a guest. In-guest tests call it
// first: on the host they are run in a guest by the package's TestVM* entry.
func RequireGuest(t testing.TB) {
	t.Helper()
	if !InGuest() {
		t.Skip("runs inside a VM guest (through the package's TestVM* test)")
	}
}

// SignalHost tells the host harness that the guest reached a point named
// name (Machine.WaitSignal returns). Guest side.
func SignalHost(name string) {
	fmt.Fprintf(os.Stdout, "%s%s\n", signalMarker, name)
}

var (
	hostLinesOnce sync.Once
	hostLines     chan string
)

// WaitHost blocks until the host harness sent name with Machine.Send,
// skipping the lines sent before it. Guest side.
func WaitHost(t testing.TB, name string) {
	t.Helper()
	RequireGuest(t)
	for {
		l, ok := hostLine()
		if !ok {
			t.Fatalf("host never sent %q", name)
		}
		if l == name {
			return
		}
	}
}

// NextHost returns the next line the host harness sent with Machine.Send,
// for a guest that runs whichever step the host names. Guest side.
func NextHost(t testing.TB) string {
	t.Helper()
	RequireGuest(t)
	l, ok := hostLine()
	if !ok {
		t.Fatal("the host stopped sending before it sent stop")
	}
	return l
}

func hostLine() (string, bool) {
	hostLinesOnce.Do(func() {
		hostLines = make(chan string, 16)
		go func() {
			sc := bufio.NewScanner(os.Stdin)
			for sc.Scan() {
				hostLines <- strings.TrimSpace(sc.Text())
			}
			close(hostLines)
		}()
	})
	l, ok := <-hostLines
	return l, ok
}
