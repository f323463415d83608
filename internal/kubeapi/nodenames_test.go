package kubeapi

import (
	"strings"
	"testing"
	"time"
)

// requestsTo counts the requests for path the API server has seen.
func (f *fakeAPI) requestsTo(path string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, r := range f.requests {
		if strings.HasSuffix(r, " "+path) {
			n++
		}
	}
	return n
}

// NodeOfKey answers at once from the last Node list: the first call
// (none read) answers "" and reads it in the background, the next names
// the node; a key no Node has, or several, names none. The list is read
// again only once it is a minute old.
func TestNodeOfKey(t *testing.T) {
	api := movedCluster()
	api.pageSize = 10 // one request per list
	tk, _ := newTestTakeover(t, api, "node-b")
	if got := tk.NodeOfKey(nodeKey("node-a")); got != "" {
		t.Fatalf("before any list: %q", got)
	}
	tk.names.bg.Wait()
	if got := tk.NodeOfKey(nodeKey("node-a")); got != "node-a" {
		t.Fatalf("NodeOfKey(node-a's key) = %q", got)
	}
	if got := tk.NodeOfKey(nodeKey("node-x")); got != "" {
		t.Fatalf("NodeOfKey(a key no Node has) = %q", got)
	}
	tk.names.bg.Wait()
	if n := api.requestsTo("/api/v1/nodes"); n != 1 {
		t.Fatalf("%d Node list reads, want 1 within a minute", n)
	}

	tk.names.mu.Lock()
	tk.names.read = time.Now().Add(-nodeNamesTTL)
	tk.names.mu.Unlock()
	api.mu.Lock()
	api.nodes = api.nodes[1:] // node-a deleted
	api.mu.Unlock()
	if got := tk.NodeOfKey(nodeKey("node-a")); got != "node-a" {
		t.Fatalf("a stale list: %q, want its name until it is read again", got)
	}
	tk.names.bg.Wait()
	if got := tk.NodeOfKey(nodeKey("node-a")); got != "" {
		t.Fatalf("after node-a was deleted: %q", got)
	}

	// Two Nodes with one key: neither is named.
	api.mu.Lock()
	api.addNode("node-a")
	api.addNode("node-a2")
	api.mu.Unlock()
	tk.cfg.NodeKey = func(n string) uint64 { return nodeKey(strings.TrimSuffix(n, "2")) }
	tk.names.mu.Lock()
	tk.names.read = time.Time{}
	tk.names.mu.Unlock()
	tk.NodeOfKey(0)
	tk.names.bg.Wait()
	if got := tk.NodeOfKey(nodeKey("node-a")); got != "" {
		t.Fatalf("a key of two nodes named %q", got)
	}
}

// NodeOfKey never waits for the API: an API that hangs answers "" at
// once, its read ends within the timeout, and a failed read is not tried
// again for each call.
func TestNodeOfKeyDoesNotWait(t *testing.T) {
	api := movedCluster()
	api.hang = true
	tk, _ := newTestTakeover(t, api, "node-b")
	start := time.Now()
	for range 3 {
		if got := tk.NodeOfKey(nodeKey("node-a")); got != "" {
			t.Fatalf("NodeOfKey = %q", got)
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("NodeOfKey waited %v", d)
	}
	tk.names.bg.Wait()
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the background read took %v, over its timeout", d)
	}
	tk.NodeOfKey(nodeKey("node-a"))
	tk.names.bg.Wait()
	if n := api.requestsTo("/api/v1/nodes"); n != 1 {
		t.Fatalf("%d Node list reads, want 1", n)
	}
}
