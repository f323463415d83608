package main

import (
	"github.com/berth-csi/berth/iscsi"
	"testing"
)

func TestParseTopology(t *testing.T) {
	got, err := parseTopology([]string{"topology.berth.csi.io/zone=a", "rack=r1"})
	if err != nil || len(got) != 2 || got["topology.berth.csi.io/zone"] != "a" || got["rack"] != "r1" {
		t.Fatalf("parseTopology: %v, %v", got, err)
	}
	for _, bad := range [][]string{{"novalue"}, {"=x"}, {"k=a", "k=b"}} {
		if _, err := parseTopology(bad); err == nil {
			t.Errorf("parseTopology(%q) accepted", bad)
		}
	}
	if got, err := parseTopology(nil); err != nil || got != nil {
		t.Fatalf("no topology: %v, %v", got, err)
	}
}

func TestNewLogger(t *testing.T) {
	for _, f := range []string{"text", "json"} {
		if _, err := newLogger(f, "debug"); err != nil {
			t.Errorf("newLogger(%q): %v", f, err)
		}
	}
	if _, err := newLogger("xml", "info"); err == nil {
		t.Error("log format xml accepted")
	}
	if _, err := newLogger("text", "loud"); err == nil {
		t.Error("log level loud accepted")
	}
}

func TestNetworkTransports(t *testing.T) {
	// iscsi needs a uevent listener (root); nvmeof opens nothing yet.
	ts, err := networkTransports("nvmeof, ,nvmeof", iscsi.Options{}, nil, nil, nil)
	if err != nil || len(ts) != 1 || ts[0].Name() != "nvmeof" {
		t.Fatalf("networkTransports: %v, %v", ts, err)
	}
	if ts, err := networkTransports("", iscsi.Options{}, nil, nil, nil); err != nil || len(ts) != 0 {
		t.Fatalf("no transports: %v, %v", ts, err)
	}
	for _, bad := range []string{"file", "fc"} {
		if _, err := networkTransports(bad, iscsi.Options{}, nil, nil, nil); err == nil {
			t.Errorf("networkTransports(%q) accepted", bad)
		}
	}
}
