package kubeapi

import (
	"context"
	"sync"
	"time"
)

// nodeNamesTTL is how long a Node list names reservation keys before it
// is read again.
const nodeNamesTTL = time.Minute

// nodeNames are the cluster's Node names by their reservation key, from
// the last Node list read, for naming a key's node in messages. A
// decision reads the Nodes itself; this list only names.
type nodeNames struct {
	mu    sync.Mutex
	byKey map[uint64][]string
	// read is when a list was last read or tried (zero: never).
	read time.Time
	// reading: a background read runs; bg waits for it (tests).
	reading bool
	bg      sync.WaitGroup
}

// storeNodeNames replaces the list with nodes, read now.
func (t *Takeover) storeNodeNames(nodes []node) {
	byKey := make(map[uint64][]string, len(nodes))
	for _, n := range nodes {
		if n.Metadata.Name != "" {
			k := t.cfg.NodeKey(n.Metadata.Name)
			byKey[k] = append(byKey[k], n.Metadata.Name)
		}
	}
	t.names.mu.Lock()
	defer t.names.mu.Unlock()
	t.names.byKey, t.names.read = byKey, time.Now()
}

// readNodeNames reads the Node list within ctx. A failure keeps the last
// list and is not tried again before nodeNamesTTL: names are for
// messages, and the API is not asked again for each one.
func (t *Takeover) readNodeNames(ctx context.Context) {
	nodes, err := t.api.listNodes(ctx)
	if err != nil {
		t.names.mu.Lock()
		t.names.read = time.Now()
		t.names.mu.Unlock()
		return
	}
	t.storeNodeNames(nodes)
}

// nameOf is the one node name the list has for key, "" for none or
// several; stale says the list is older than nodeNamesTTL.
func (t *Takeover) nameOf(key uint64) (name string, stale bool) {
	t.names.mu.Lock()
	defer t.names.mu.Unlock()
	if ns := t.names.byKey[key]; len(ns) == 1 {
		name = ns[0]
	}
	return name, time.Since(t.names.read) >= nodeNamesTTL
}

// NodeOfKey names the one Node whose name has the reservation key key,
// from the last Node list read; "" when no Node or several have it or no
// list was read. It never waits for the API: a list older than a minute
// is read again in the background (within Config.Timeout) for the next
// caller.
func (t *Takeover) NodeOfKey(key uint64) string {
	name, stale := t.nameOf(key)
	if !stale {
		return name
	}
	t.names.mu.Lock()
	defer t.names.mu.Unlock()
	if !t.names.reading {
		t.names.reading = true
		t.names.bg.Add(1)
		go func() {
			defer t.names.bg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), t.cfg.Timeout)
			defer cancel()
			t.readNodeNames(ctx)
			t.names.mu.Lock()
			t.names.reading = false
			t.names.mu.Unlock()
		}()
	}
	return name
}

// holderName is NodeOfKey for a decision, which may wait within ctx: a
// stale list is read again first.
func (t *Takeover) holderName(ctx context.Context, key uint64) string {
	if name, stale := t.nameOf(key); !stale {
		return name
	}
	t.readNodeNames(ctx)
	name, _ := t.nameOf(key)
	return name
}
