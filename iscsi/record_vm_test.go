package iscsi

import (
	"context"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/berth-csi/berth/test/vm"
)

// The record berth writes itself reads back through iscsiadm exactly like
// one iscsiadm created (`-o new`, then the same settings), field for
// field, including a setting changed in iscsid.conf.
func TestGuestISCSINodeRecordMatchesIscsiadm(t *testing.T) {
	vm.RequireGuest(t)
	const conf = "/etc/iscsi/iscsid.conf"
	orig, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(conf, orig, 0o600) })
	changed := strings.Replace(string(orig), "node.session.cmds_max = 128", "node.session.cmds_max = 64", 1)
	if changed == string(orig) {
		t.Fatal("iscsid.conf has no node.session.cmds_max = 128 line to change")
	}
	if err := os.WriteFile(conf, []byte(changed), 0o600); err != nil {
		t.Fatal(err)
	}

	const byTool, byBerth, portal = "iqn.2026-01.io.berth:record-tool", "iqn.2026-01.io.berth:record-berth", "127.0.0.1:3260"
	iscsiadm := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("iscsiadm", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("iscsiadm %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	t.Cleanup(func() {
		for _, iqn := range []string{byTool, byBerth} {
			exec.Command("iscsiadm", "-m", "node", "-o", "delete", "-T", iqn).Run()
		}
	})
	iscsiadm("-m", "node", "-o", "new", "-T", byTool, "-p", portal)
	set := []setting{{"node.startup", "manual"}, {"node.session.scan", "manual"}, {ParamReplacementTimeout, "20"}}
	for _, s := range set {
		iscsiadm("-m", "node", "-T", byTool, "-p", portal, "-o", "update", "-n", s.name, "-v", s.value)
	}
	if _, err := (&recordDB{}).createNodeRecord(context.Background(), byBerth, "127.0.0.1", 3260, -1, set); err != nil {
		t.Fatal(err)
	}

	tool := parseRecord([]byte(iscsiadm("-m", "node", "-T", byTool, "-p", portal)))
	berth := parseRecord([]byte(iscsiadm("-m", "node", "-T", byBerth, "-p", portal)))
	if berth["node.name"] != byBerth || tool["node.session.cmds_max"] != "64" {
		t.Fatalf("records not read back: berth node.name %q, iscsiadm cmds_max %q", berth["node.name"], tool["node.session.cmds_max"])
	}
	delete(tool, "node.name")
	delete(berth, "node.name")
	for _, k := range slices.Sorted(maps.Keys(tool)) {
		if tool[k] != berth[k] {
			t.Errorf("%s: iscsiadm's record has %q, berth's %q", k, tool[k], berth[k])
		}
	}
	for k := range berth {
		if _, ok := tool[k]; !ok {
			t.Errorf("%s: only in berth's record", k)
		}
	}
	t.Logf("%d fields compared", len(tool))
}
