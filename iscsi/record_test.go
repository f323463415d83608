package iscsi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
)

// A record as iscsiadm 2.1.8 writes it (abridged).
const sampleRecord = `# BEGIN RECORD 2.1.8
node.name = iqn.2003-01.org.linux-iscsi.target:vol1
node.tpgt = 1
node.startup = automatic
iface.iscsi_ifacename = default
iface.transport_name = tcp
node.discovery_address = 10.0.0.1
node.session.scan = auto
node.session.auth.authmethod = None
node.session.timeo.replacement_timeout = 120
node.conn[0].address = 10.0.0.1
node.conn[0].port = 3260
node.conn[0].timeo.login_timeout = 15
# END RECORD
`

func TestSetRecordValues(t *testing.T) {
	out, err := setRecordValues([]byte(sampleRecord), []setting{
		{"node.startup", "manual"},
		{"node.session.scan", "manual"},
		{"node.session.auth.authmethod", "CHAP"},
		{SecretSessionUsername, "user1"},
		{SecretSessionPassword, "pa ss=#word"},
		{ParamLoginTimeout, "5"},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := parseRecord(out)
	want := map[string]string{
		"node.name":                    testIQN,
		"node.startup":                 "manual",
		"node.session.scan":            "manual",
		"node.session.auth.authmethod": "CHAP",
		SecretSessionUsername:          "user1",
		SecretSessionPassword:          "pa ss=#word",
		ParamLoginTimeout:              "5",
		ParamReplacementTimeout:        "120",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	s := string(out)
	if !strings.HasPrefix(s, "# BEGIN RECORD 2.1.8\n") || !strings.HasSuffix(s, "# END RECORD\n") {
		t.Fatalf("record framing lost:\n%s", s)
	}
	if strings.Count(s, "node.startup") != 1 {
		t.Fatalf("duplicate lines:\n%s", s)
	}
	// Idempotent.
	again, err := setRecordValues(out, []setting{{"node.startup", "manual"}, {SecretSessionPassword, "pa ss=#word"}})
	if err != nil || string(again) != s {
		t.Fatalf("second pass changed the record: %v\n%s", err, again)
	}
}

func TestSetRecordValuesRejects(t *testing.T) {
	for _, s := range []setting{
		{"node.session.auth.password", "a\nnode.startup = automatic"},
		{"node.session.auth.password", " lead"},
		{"node.session.auth.password", ""},
		{"bad key", "x"},
		{"k=v", "x"},
	} {
		_, err := setRecordValues([]byte(sampleRecord), []setting{s})
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q accepted: %v", s.name, err)
		}
		if err != nil && s.value != "" && strings.Contains(err.Error(), s.value) {
			t.Errorf("error quotes the value: %v", err)
		}
	}
}

func TestRecordDBUpdate(t *testing.T) {
	dir := t.TempDir()
	db := recordDB{nodes: filepath.Join(dir, "nodes"), lockDir: filepath.Join(dir, "lock")}
	// Current layout and the pre-2007 one.
	cur := filepath.Join(db.nodes, testIQN, "10.0.0.1,3260,1", "default")
	old := filepath.Join(db.nodes, testIQN, "10.0.0.2,3260")
	for _, f := range []string{cur, old} {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte(sampleRecord), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	files, err := db.nodeRecordFiles(testIQN, "10.0.0.1", 3260, "default")
	if err != nil || len(files) != 1 || files[0] != cur {
		t.Fatalf("current layout: %v %v", files, err)
	}
	files2, err := db.nodeRecordFiles(testIQN, "10.0.0.2", 3260, "default")
	if err != nil || len(files2) != 1 || files2[0] != old {
		t.Fatalf("old layout: %v %v", files2, err)
	}
	if _, err := db.nodeRecordFiles(testIQN, "10.0.0.1", 3260, "iface1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("other iface: %v", err)
	}
	if _, err := db.nodeRecordFiles(testIQN, "10.0.0.3", 3260, "default"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing: %v", err)
	}

	ctx := context.Background()
	if err := db.update(ctx, append(files, files2...), []setting{{SecretSessionPassword, "topsecret1"}}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{cur, old} {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", f, st.Mode().Perm())
		}
		b, _ := os.ReadFile(f)
		if parseRecord(b)[SecretSessionPassword] != "topsecret1" {
			t.Errorf("%s: password not written", f)
		}
	}
	if _, err := os.Stat(filepath.Join(db.lockDir, "lock.write")); !os.IsNotExist(err) {
		t.Fatalf("lock not released: %v", err)
	}
}

func TestRecordLockHeld(t *testing.T) {
	dir := t.TempDir()
	db := recordDB{nodes: dir, lockDir: dir}
	unlock, err := db.lock(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := db.lock(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second lock while held: %v", err)
	}
	unlock()
	unlock2, err := db.lock(context.Background())
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	unlock2()
}
