package kubeapi

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"maps"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

const driver = "berth.csi.io"

// nodeKey is berth's reservation key of a node (the node side's formula):
// 0xB3E7 in the top 16 bits, then the first 6 bytes of
// SHA-256("berth-node:" + nodeID).
func nodeKey(nodeID string) uint64 {
	sum := sha256.Sum256([]byte("berth-node:" + nodeID))
	var b [8]byte
	copy(b[2:], sum[:6])
	return 0xB3E7<<48 | binary.BigEndian.Uint64(b[:])
}

// The name must be the one the kubelet and the attach-detach controller
// compute: the value below is `printf %s pvc-0001berth.csi.ionode-a |
// sha256sum`, not this package's code.
func TestAttachmentName(t *testing.T) {
	const want = "csi-953f42a05b9606517ef5fecfd67fab6ae422e377544c8eb8b5277bbeebeedd06"
	if got := AttachmentName("pvc-0001", driver, "node-a"); got != want {
		t.Fatalf("AttachmentName = %s, want %s", got, want)
	}
	if AttachmentName("pvc-0001", driver, "node-b") == want {
		t.Fatal("the node name is not part of the name")
	}
}

func TestNodeKeyFormula(t *testing.T) {
	// printf %s berth-node:node-a | sha256sum: 2e55d81a228c...
	if got, want := nodeKey("node-a"), uint64(0xB3E72e55d81a228c); got != want {
		t.Fatalf("nodeKey(node-a) = %#x, want %#x", got, want)
	}
}

// fakeAPI is an API server with VolumeAttachments and Nodes, and the
// failures a test asks for.
type fakeAPI struct {
	mu       sync.Mutex
	token    string
	vas      map[string]map[string]any
	nodes    []map[string]any
	pageSize int
	// fail maps a path prefix to the status it answers with; failExact a
	// whole path.
	fail, failExact map[string]int
	// hang makes every request wait until the client gives up.
	hang     bool
	requests []string
}

func newFakeAPI() *fakeAPI {
	return &fakeAPI{token: "tok-1", vas: map[string]map[string]any{}, fail: map[string]int{}, failExact: map[string]int{}, pageSize: 2}
}

func (f *fakeAPI) addNode(name string, taints ...string) {
	var ts []map[string]any
	for _, k := range taints {
		ts = append(ts, map[string]any{"key": k, "effect": "NoExecute"})
	}
	f.nodes = append(f.nodes, map[string]any{"metadata": map[string]any{"name": name}, "spec": map[string]any{"taints": ts}})
}

func (f *fakeAPI) addVA(volume, node string, attached, deleting bool) {
	name := AttachmentName(volume, driver, node)
	md := map[string]any{"name": name}
	if deleting {
		md["deletionTimestamp"] = "2026-12-04T20:00:00Z"
	}
	f.vas[name] = map[string]any{
		"metadata": md,
		"spec":     map[string]any{"attacher": driver, "nodeName": node, "source": map[string]any{"persistentVolumeName": volume}},
		"status":   map[string]any{"attached": attached},
	}
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, r.Method+" "+r.URL.Path)
	if f.hang {
		f.mu.Unlock()
		<-r.Context().Done()
		f.mu.Lock()
		return
	}
	status := func(code int, msg string) {
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "code": code, "message": msg})
	}
	if r.Header.Get("Authorization") != "Bearer "+f.token {
		status(http.StatusUnauthorized, "Unauthorized")
		return
	}
	if r.Method != http.MethodGet || r.URL.Query().Has("resourceVersion") {
		status(http.StatusBadRequest, "want a quorum GET")
		return
	}
	if code, ok := f.failExact[r.URL.Path]; ok {
		status(code, "injected")
		return
	}
	for prefix, code := range f.fail {
		if strings.HasPrefix(r.URL.Path, prefix) {
			status(code, "injected")
			return
		}
	}
	switch {
	case strings.HasPrefix(r.URL.Path, "/apis/storage.k8s.io/v1/volumeattachments/"):
		va, ok := f.vas[strings.TrimPrefix(r.URL.Path, "/apis/storage.k8s.io/v1/volumeattachments/")]
		if !ok {
			status(http.StatusNotFound, "volumeattachments not found")
			return
		}
		json.NewEncoder(w).Encode(va)
	case r.URL.Path == "/api/v1/nodes":
		f.page(w, r, "NodeList", f.nodes)
	case r.URL.Path == "/apis/storage.k8s.io/v1/volumeattachments":
		var items []map[string]any
		for _, name := range slices.Sorted(maps.Keys(f.vas)) {
			items = append(items, f.vas[name])
		}
		f.page(w, r, "VolumeAttachmentList", items)
	default:
		status(http.StatusNotFound, "no such path")
	}
}

// page answers one page of a list, pageSize items from the continue
// token on.
func (f *fakeAPI) page(w http.ResponseWriter, r *http.Request, kind string, items []map[string]any) {
	start := 0
	if c := r.URL.Query().Get("continue"); c != "" {
		fmt.Sscan(c, &start)
	}
	end := min(start+f.pageSize, len(items))
	md := map[string]any{}
	if end < len(items) {
		md["continue"] = fmt.Sprint(end)
	}
	json.NewEncoder(w).Encode(map[string]any{"kind": kind, "metadata": md, "items": items[start:end]})
}

// newTestTakeover serves api over TLS and returns node's Takeover against
// it, using the server's certificate as the CA file and a token file.
func newTestTakeover(t *testing.T, api *fakeAPI, node string) (*Takeover, string) {
	t.Helper()
	srv := httptest.NewTLSServer(api)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.crt")
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tokenFile, []byte(api.token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(srv.URL)
	host, port, _ := net.SplitHostPort(u.Host)
	t.Setenv("KUBERNETES_SERVICE_HOST", host)
	t.Setenv("KUBERNETES_SERVICE_PORT", port)
	tk, err := NewInCluster(Config{DriverName: driver, NodeName: node, NodeKey: nodeKey, TokenFile: tokenFile, CAFile: caFile, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return tk, tokenFile
}

// The usual cluster: nodes a, b, c; the volume moved from a to b.
func movedCluster() *fakeAPI {
	api := newFakeAPI()
	api.addNode("node-a")
	api.addNode("node-b")
	api.addNode("node-c")
	api.addVA("pvc-1", "node-b", true, false)
	return api
}

func wantDecision(t *testing.T, d Decision, allowed bool, holderNode string, reason ...string) {
	t.Helper()
	if d.Allowed != allowed || d.HolderNode != holderNode {
		t.Errorf("decision = %+v, want allowed=%v holder node %q", d, allowed, holderNode)
	}
	for _, r := range reason {
		if !strings.Contains(d.Reason, r) {
			t.Errorf("reason %q does not say %q", d.Reason, r)
		}
	}
}

func TestTakeoverAllowed(t *testing.T) {
	ctx := context.Background()
	t.Run("holder has no attachment", func(t *testing.T) {
		tk, _ := newTestTakeover(t, movedCluster(), "node-b")
		wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), true, "node-a", "none attaches it to the holder node-a")
	})
	t.Run("holder out of service", func(t *testing.T) {
		api := movedCluster()
		api.nodes = api.nodes[1:]
		api.addNode("node-a", "node.kubernetes.io/unreachable", TaintOutOfService)
		api.addVA("pvc-1", "node-a", true, false) // not force-detached yet
		tk, _ := newTestTakeover(t, api, "node-b")
		wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), true, "node-a", TaintOutOfService)
	})
	t.Run("holder node deleted", func(t *testing.T) {
		api := movedCluster()
		api.nodes = api.nodes[1:]
		api.addVA("pvc-2", "node-c", true, false) // another volume's
		api.addVA("pvc-3", "node-a", true, false)
		tk, _ := newTestTakeover(t, api, "node-b")
		wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), true, "", "no Node has the holder's key", "no VolumeAttachment of pvc-1 names another node")
	})
	t.Run("holder on the last page", func(t *testing.T) {
		api := newFakeAPI()
		for i := range 7 {
			api.addNode(fmt.Sprintf("node-%d", i))
		}
		api.addNode("node-a")
		api.addVA("pvc-1", "node-b", true, false)
		api.addVA("pvc-1", "node-a", true, false)
		tk, _ := newTestTakeover(t, api, "node-b")
		// Found on the fifth page, with its attachment still there.
		wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), false, "node-a", "still has VolumeAttachment")
	})
}

func TestTakeoverRefused(t *testing.T) {
	ctx := context.Background()
	holder := nodeKey("node-a")
	for name, tc := range map[string]struct {
		setup      func(*fakeAPI)
		holderNode string
		reason     []string
	}{
		"holder still attached": {
			setup:      func(api *fakeAPI) { api.addVA("pvc-1", "node-a", true, false) },
			holderNode: "node-a",
			reason:     []string{"node-a still has VolumeAttachment " + AttachmentName("pvc-1", driver, "node-a"), "(attached)"},
		},
		"holder being detached": {
			setup:      func(api *fakeAPI) { api.addVA("pvc-1", "node-a", true, true) },
			holderNode: "node-a",
			reason:     []string{"being detached"},
		},
		// The holder's berth runs as node-x on the Node node-a: no Node
		// has node-x's key, but node-a still has the volume attached.
		"holder under another node id": {
			setup:  func(api *fakeAPI) { api.addVA("pvc-1", "node-a", true, false) },
			reason: []string{"no Node has the holder's key", "still gives pvc-1 to node node-a", "--node-id"},
		},
		"holder unknown, attachments not listable": {
			setup:  func(api *fakeAPI) { api.failExact["/apis/storage.k8s.io/v1/volumeattachments"] = http.StatusForbidden },
			reason: []string{"cannot be listed", "403"},
		},
		"holder unknown, inline volume": {
			setup: func(api *fakeAPI) {
				api.vas[AttachmentName("pvc-1", driver, "node-b")]["spec"].(map[string]any)["source"] = map[string]any{"inlineVolumeSpec": map[string]any{}}
			},
			reason: []string{"names no PersistentVolume"},
		},
		// Refusals before the decision reads the Nodes name the
		// holder from a Node list too.
		"own attachment missing": {
			setup:      func(api *fakeAPI) { delete(api.vas, AttachmentName("pvc-1", driver, "node-b")) },
			holderNode: "node-a",
			reason:     []string{"no VolumeAttachment", "0xb3e72e55d81a228c"},
		},
		"own attachment not attached yet": {
			setup:      func(api *fakeAPI) { api.addVA("pvc-1", "node-b", false, false) },
			holderNode: "node-a",
			reason:     []string{"is not attached yet"},
		},
		"own attachment being deleted": {
			setup:      func(api *fakeAPI) { api.addVA("pvc-1", "node-b", true, true) },
			holderNode: "node-a",
			reason:     []string{"being deleted"},
		},
		"own attachment another driver's": {
			setup: func(api *fakeAPI) {
				api.vas[AttachmentName("pvc-1", driver, "node-b")]["spec"].(map[string]any)["attacher"] = "other.csi.io"
			},
			holderNode: "node-a",
			reason:     []string{"other.csi.io"},
		},
		"token expired": {
			setup:  func(api *fakeAPI) { api.token = "tok-2" },
			reason: []string{"401", "expired"},
		},
		"attachments forbidden": {
			setup:      func(api *fakeAPI) { api.fail["/apis/storage.k8s.io/"] = http.StatusForbidden },
			holderNode: "node-a",
			reason:     []string{"403", "get and list on volumeattachments"},
		},
		"nodes forbidden": {
			setup:  func(api *fakeAPI) { api.fail["/api/v1/nodes"] = http.StatusForbidden },
			reason: []string{"cannot list the nodes", "403"},
		},
		"server error": {
			setup:      func(api *fakeAPI) { api.fail["/apis/"] = http.StatusInternalServerError },
			holderNode: "node-a",
			reason:     []string{"500"},
		},
		"server error, nodes too": {
			setup:  func(api *fakeAPI) { api.fail["/"] = http.StatusInternalServerError },
			reason: []string{"500"},
		},
		"timeout": {
			setup:  func(api *fakeAPI) { api.hang = true },
			reason: []string{"deadline exceeded"},
		},
		"holder is this node": {
			setup:  func(api *fakeAPI) {},
			reason: []string{"this node's own"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			api := movedCluster()
			tk, _ := newTestTakeover(t, api, "node-b")
			api.mu.Lock()
			tc.setup(api)
			api.mu.Unlock()
			h := holder
			switch {
			case name == "holder is this node":
				h = nodeKey("node-b")
			case strings.HasPrefix(name, "holder unknown") || name == "holder under another node id":
				h = nodeKey("node-x")
			}
			start := time.Now()
			wantDecision(t, tk.Authorize(ctx, "pvc-1", h), false, tc.holderNode, tc.reason...)
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("the decision took %v, over its timeout", d)
			}
		})
	}
}

// A node that was partitioned off (node-a) comes back while its kubelet
// still retries the stage of a pod that was deleted meanwhile; the volume
// now lives on node-b, which fenced node-a. node-a finds node-b's
// reservation and asks: its own VolumeAttachment is gone, so it must never
// take the volume back, whatever node-b's state.
func TestTakeoverPartitionedNodeNeverTakesBack(t *testing.T) {
	for name, setup := range map[string]func(*fakeAPI){
		"new owner attached": func(*fakeAPI) {},
		"new owner tainted": func(api *fakeAPI) {
			api.nodes = api.nodes[:1]
			api.addNode("node-b", TaintOutOfService)
		},
		"new owner node gone":      func(api *fakeAPI) { api.nodes = api.nodes[:1] },
		"new owner detached":       func(api *fakeAPI) { delete(api.vas, AttachmentName("pvc-1", driver, "node-b")) },
		"old one being detached":   func(api *fakeAPI) { api.addVA("pvc-1", "node-a", true, true) },
		"old one not attached yet": func(api *fakeAPI) { api.addVA("pvc-1", "node-a", false, false) },
	} {
		t.Run(name, func(t *testing.T) {
			api := newFakeAPI()
			api.addNode("node-a")
			api.addNode("node-b")
			api.addVA("pvc-1", "node-b", true, false)
			setup(api)
			tk, _ := newTestTakeover(t, api, "node-a")
			d := tk.Authorize(context.Background(), "pvc-1", nodeKey("node-b"))
			if d.Allowed {
				t.Fatalf("the partitioned node may take the volume back: %+v", d)
			}
		})
	}
}

// The token is read again for each decision: a rotated token is used at
// once, a missing or empty one refuses (naming the holder from the Node
// list the first decision read).
func TestTakeoverToken(t *testing.T) {
	api := movedCluster()
	tk, tokenFile := newTestTakeover(t, api, "node-b")
	ctx := context.Background()
	wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), true, "node-a")
	api.mu.Lock()
	api.token = "tok-rotated"
	api.mu.Unlock()
	wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), false, "node-a", "401")
	if err := os.WriteFile(tokenFile, []byte("tok-rotated"), 0o600); err != nil {
		t.Fatal(err)
	}
	wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), true, "node-a")
	if err := os.WriteFile(tokenFile, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	wantDecision(t, tk.Authorize(ctx, "pvc-1", nodeKey("node-a")), false, "node-a", "is empty")
	os.Remove(tokenFile)
	d := tk.Authorize(ctx, "pvc-1", nodeKey("node-a"))
	wantDecision(t, d, false, "node-a", "read the service-account token")
	if strings.Contains(d.Reason, "tok-") {
		t.Errorf("the reason names a token: %s", d.Reason)
	}
}

// A server whose certificate the CA file does not vouch for is never
// asked.
func TestTakeoverUntrustedServer(t *testing.T) {
	api := movedCluster()
	tk, _ := newTestTakeover(t, api, "node-b")
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "other CA"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tk.api.caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	wantDecision(t, tk.Authorize(context.Background(), "pvc-1", nodeKey("node-a")), false, "", "certificate")
	if err := os.WriteFile(tk.api.caFile, []byte("junk"), 0o600); err != nil {
		t.Fatal(err)
	}
	wantDecision(t, tk.Authorize(context.Background(), "pvc-1", nodeKey("node-a")), false, "", "no PEM certificate")
	api.mu.Lock()
	defer api.mu.Unlock()
	if len(api.requests) != 0 {
		t.Errorf("requests reached the server: %v", api.requests)
	}
}

func TestNewInClusterNeedsTheEnvironment(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")
	if _, err := NewInCluster(Config{DriverName: driver, NodeName: "n", NodeKey: nodeKey}); err == nil || !strings.Contains(err.Error(), "KUBERNETES_SERVICE_HOST") {
		t.Fatalf("NewInCluster outside a pod: %v", err)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "443")
	if _, err := NewInCluster(Config{DriverName: driver, NodeKey: nodeKey}); err == nil {
		t.Fatal("NewInCluster without a node name: no error")
	}
}
