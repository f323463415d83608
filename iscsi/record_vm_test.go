package iscsi

import (
	"context"
	"fmt"
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

	iscsiadm := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("iscsiadm", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("iscsiadm %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	set := []setting{{"node.startup", "manual"}, {"node.session.scan", "manual"}, {ParamReplacementTimeout, "20"}}
	for i, tc := range []struct {
		portal, address string
		tpgt            int
	}{
		{"127.0.0.1:3260", "127.0.0.1", -1},
		{"127.0.0.1:3260,1", "127.0.0.1", 1},
		{"[::1]:3260", "::1", -1},
	} {
		byTool, byBerth := fmt.Sprintf("iqn.2026-01.io.berth:record-tool-%d", i), fmt.Sprintf("iqn.2026-01.io.berth:record-berth-%d", i)
		t.Cleanup(func() {
			for _, iqn := range []string{byTool, byBerth} {
				exec.Command("iscsiadm", "-m", "node", "-o", "delete", "-T", iqn).Run()
			}
		})
		iscsiadm("-m", "node", "-o", "new", "-T", byTool, "-p", tc.portal)
		for _, s := range set {
			iscsiadm("-m", "node", "-T", byTool, "-p", tc.portal, "-o", "update", "-n", s.name, "-v", s.value)
		}
		if _, err := (&recordDB{}).createNodeRecord(context.Background(), byBerth, tc.address, 3260, tc.tpgt, set); err != nil {
			t.Fatal(err)
		}

		tool := parseRecord([]byte(iscsiadm("-m", "node", "-T", byTool, "-p", tc.portal)))
		berth := parseRecord([]byte(iscsiadm("-m", "node", "-T", byBerth, "-p", tc.portal)))
		if berth["node.name"] != byBerth || tool["node.session.cmds_max"] != "64" {
			t.Fatalf("%s: records not read back: berth node.name %q, iscsiadm cmds_max %q", tc.portal, berth["node.name"], tool["node.session.cmds_max"])
		}
		delete(tool, "node.name")
		delete(berth, "node.name")
		for _, k := range slices.Sorted(maps.Keys(tool)) {
			if tool[k] != berth[k] {
				t.Errorf("%s: %s: iscsiadm's record has %q, berth's %q", tc.portal, k, tool[k], berth[k])
			}
		}
		for k := range berth {
			if _, ok := tool[k]; !ok {
				t.Errorf("%s: %s: only in berth's record", tc.portal, k)
			}
		}
		t.Logf("%s: %d fields compared", tc.portal, len(tool))
	}
}
