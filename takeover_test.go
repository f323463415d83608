package main

import (
	"context"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
)

// The key of a node: `printf %s berth-node:node-a | sha256sum` begins
// 2e55d81a228c; berth's mark 0xB3E7 above it.
func TestNodeKey(t *testing.T) {
	if got, want := agent.NodeKey("node-a"), uint64(0xB3E72e55d81a228c); got != want {
		t.Fatalf("agent.NodeKey(node-a) = %#x, want %#x", got, want)
	}
	if agent.NodeKey("node-a") == agent.NodeKey("node-b") {
		t.Fatal("two nodes, one key")
	}
	for _, s := range []string{"node-a", "0xb3e72e55d81a228c", "0XB3E72E55D81A228C"} {
		if got := parseHolder(s); got != 0xB3E72e55d81a228c {
			t.Errorf("parseHolder(%q) = %#x", s, got)
		}
	}
}

// The authority answers for its own node only.
func TestKubeTakeoverOtherNode(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "1")
	a, err := newKubeTakeover(agent.DefaultDriverName, "node-b")
	if err != nil {
		t.Fatal(err)
	}
	d, err := a.AuthorizeTakeover(context.Background(), agent.TakeoverRequest{VolumeID: "v", NodeID: "node-c", Holder: agent.NodeKey("node-a")})
	if err != nil || d.Allowed || !strings.Contains(d.Reason, "node-c") {
		t.Fatalf("decision %+v, %v: want a refusal naming node-c", d, err)
	}
	// The API at port 1 answers nothing: refused, not an error.
	d, err = a.AuthorizeTakeover(context.Background(), agent.TakeoverRequest{VolumeID: "v", NodeID: "node-b", Holder: agent.NodeKey("node-a")})
	if err != nil || d.Allowed || d.Reason == "" {
		t.Fatalf("decision %+v, %v: want a refusal with a reason", d, err)
	}
}

// berth serve --takeover-from-kubernetes outside a pod stops at startup,
// naming what is missing, instead of refusing every takeover later.
func TestServeTakeoverFlagOutsideAPod(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	cmd := serveCommand()
	cmd.Action = func(c *cli.Context) error {
		_, err := newServer(c)
		return err
	}
	app := &cli.App{Name: "berth", Commands: []*cli.Command{cmd}}
	err := app.Run([]string{"berth", "serve", "--takeover-from-kubernetes", "--endpoint", "unix://" + t.TempDir() + "/csi.sock", "--state-dir", t.TempDir(), "--log-format", "text"})
	if err == nil || !strings.Contains(err.Error(), "--takeover-from-kubernetes") || !strings.Contains(err.Error(), "KUBERNETES_SERVICE_HOST") {
		t.Fatalf("serve outside a pod: %v", err)
	}
}
