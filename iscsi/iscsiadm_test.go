package iscsi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/command"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/sysfs/sysfstest"
)

func TestSentinelForExit(t *testing.T) {
	tests := []struct {
		code int
		want error
	}{
		{ISCSI_ERR_LOGIN_AUTH_FAILED, errdefs.ErrPermissionDenied},
		{ISCSI_ERR_ISCSID_NOTCONN, errdefs.ErrUnavailable},
		{ISCSI_ERR_ISCSID_COMM_ERR, errdefs.ErrUnavailable},
		{ISCSI_ERR_TRANS_TIMEOUT, errdefs.ErrUnavailable},
		{ISCSI_ERR_TRANS_NOT_FOUND, errdefs.ErrUnavailable},
		{ISCSI_ERR_FATAL_LOGIN, errdefs.ErrFailedPrecondition},
		{ISCSI_ERR_NO_OBJS_FOUND, errdefs.ErrNotFound},
		{ISCSI_ERR_SESS_EXISTS, errdefs.ErrAlreadyExists},
		{ISCSI_ERR_INTERNAL, nil},
	}
	for _, tt := range tests {
		if got := sentinelForExit(tt.code); got != tt.want {
			t.Errorf("exit %d: %v, want %v", tt.code, got, tt.want)
		}
	}
	// The numbers are iscsi_err.h's.
	if ISCSI_ERR_SESS_EXISTS != 15 || ISCSI_ERR_ISCSID_NOTCONN != 20 || ISCSI_ERR_NO_OBJS_FOUND != 21 || ISCSI_ERR_LOGIN_AUTH_FAILED != 24 || ISCSI_ERR_TRANS_TIMEOUT != 8 {
		t.Fatal("exit code constants drifted from include/iscsi_err.h")
	}
}

// TestExecRunnerExitCode runs a stand-in iscsiadm that fails like a CHAP
// rejection and checks the error carries the code, the message and the
// sentinel.
func TestExecRunnerExitCode(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "iscsiadm")
	script := "#!/bin/sh\necho 'iscsiadm: Login failed to authenticate with target' >&2\nexit 24\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := execRunner{}.run(context.Background(), bin, "-m", "node", "--login")
	if !errors.Is(err, errdefs.ErrPermissionDenied) || command.ExitCode(err) != 24 {
		t.Fatalf("got %v (code %d)", err, command.ExitCode(err))
	}
	if !strings.Contains(err.Error(), "failed to authenticate") || !strings.Contains(err.Error(), "CHAP authentication failed") {
		t.Fatalf("message lacks the tool's words: %v", err)
	}
	tr := &Transport{opts: Options{Iscsiadm: bin}}
	werr := tr.iscsiadmError("log in", err)
	if !errors.Is(werr, errdefs.ErrPermissionDenied) || !strings.Contains(werr.Error(), "secret") {
		t.Fatalf("login error: %v", werr)
	}
	if strings.Contains(strings.ToLower(werr.Error()), "timed out") {
		t.Fatalf("auth failure reads like a timeout: %v", werr)
	}

	_, err = execRunner{}.run(context.Background(), filepath.Join(t.TempDir(), "missing"))
	if werr := tr.iscsiadmError("log in", err); !errors.Is(werr, errdefs.ErrUnavailable) {
		t.Fatalf("missing binary: %v", werr)
	}
}

// fakeRunner records argument vectors and plays iscsiadm's record creation.
type fakeRunner struct {
	nodes string
	argv  [][]string
	fail  map[string]int // first argv element after the mode flag -> exit code
}

func (f *fakeRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	f.argv = append(f.argv, append([]string{name}, args...))
	joined := strings.Join(args, " ")
	for k, code := range f.fail {
		if strings.Contains(joined, k) {
			return nil, exitError(name, args, code)
		}
	}
	if strings.Contains(joined, "-o new") && args[1] == "node" {
		var target, portal, iface string
		for i := 0; i+1 < len(args); i++ {
			switch args[i] {
			case "-T":
				target = args[i+1]
			case "-p":
				portal = args[i+1]
			case "-I":
				iface = args[i+1]
			}
		}
		hp, tpgt, ok := strings.Cut(portal, ",")
		if !ok {
			tpgt = "-1"
		}
		host, port, _ := strings.Cut(hp, ":")
		dir := filepath.Join(f.nodes, target, host+","+port+","+tpgt)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		return nil, os.WriteFile(filepath.Join(dir, iface), []byte(sampleRecord), 0o600)
	}
	if strings.Contains(joined, "-o delete") && args[1] == "node" {
		var target, portal string
		for i := 0; i+1 < len(args); i++ {
			switch args[i] {
			case "-T":
				target = args[i+1]
			case "-p":
				portal = args[i+1]
			}
		}
		hp, _, _ := strings.Cut(portal, ",")
		host, port, _ := strings.Cut(hp, ":")
		matches, _ := filepath.Glob(filepath.Join(f.nodes, target, host+","+port+"*"))
		for _, m := range matches {
			os.RemoveAll(m)
		}
	}
	return nil, nil
}

// exitError is the error of an iscsiadm run that exited with code, as
// execRunner makes it.
func exitError(name string, args []string, code int) error {
	return &command.Error{Args: append([]string{name}, args...), ExitCode: code, Kind: sentinelForExit(code), Meaning: exitMeaning(code)}
}

func testTransport(t *testing.T, r runner) *Transport {
	dir := t.TempDir()
	return &Transport{
		opts: Options{Iscsiadm: "iscsiadm", Multipathd: "multipathd", Params: map[string]int{ParamReplacementTimeout: 20, ParamLoginTimeout: 9}},
		log:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		sys:  sysTree{root: sysfstest.New(t).Root()},
		db:   recordDB{nodes: filepath.Join(dir, "nodes"), lockDir: filepath.Join(dir, "lock"), walks: &recordWalks{dir: filepath.Join(dir, "lock")}},
		run:  r,
	}
}

// TestLoginKeepsSecretsOutOfArgv logs in with mutual CHAP through the fake
// iscsiadm: every argument vector is free of the credentials, which end up
// in the 0600 record with the manual scan and session parameters.
func TestLoginKeepsSecretsOutOfArgv(t *testing.T) {
	v, err := ParseVolume(ctxWith("sessionCHAPAuth", "true", ParamLoginTimeout, "4"), chapSecrets)
	if err != nil {
		t.Fatal(err)
	}
	fr := &fakeRunner{}
	tr := testTransport(t, fr)
	fr.nodes = tr.db.nodes
	p := path{Portal: v.Portals[0], IP: "10.0.0.1"}
	if err := tr.login(context.Background(), v, p); err != nil {
		t.Fatal(err)
	}
	if len(fr.argv) != 2 {
		t.Fatalf("want node new + login, got %q", fr.argv)
	}
	for _, argv := range fr.argv {
		for _, a := range argv {
			for k, s := range chapSecrets {
				if strings.Contains(a, s) {
					t.Fatalf("argv %q holds secret %s", argv, k)
				}
			}
			if strings.Contains(a, "auth") {
				t.Fatalf("argv %q names an auth field", argv)
			}
		}
	}
	f := filepath.Join(tr.db.nodes, testIQN, "10.0.0.1,3260,-1", "default")
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	rec := parseRecord(b)
	for k, want := range map[string]string{
		"node.startup": "manual", "node.session.scan": "manual", "node.session.auth.authmethod": "CHAP",
		SecretSessionUsername: "user1", SecretSessionPassword: "s3cret-Passw0rd",
		SecretSessionUsernameIn: "target1", SecretSessionPasswordIn: "s3cret-Mutual99",
		ParamReplacementTimeout: "20", // node-wide
		ParamLoginTimeout:       "4",  // the volume's value wins
	} {
		if rec[k] != want {
			t.Errorf("record %s = %q, want %q", k, rec[k], want)
		}
	}
	if st, _ := os.Stat(f); st.Mode().Perm() != 0o600 {
		t.Errorf("record mode %v", st.Mode().Perm())
	}
}

// TestLoginFailureDeletesRecord: a failed login leaves no record (and no
// credentials) and names authentication.
func TestLoginFailureDeletesRecord(t *testing.T) {
	v, err := ParseVolume(ctxWith("sessionCHAPAuth", "true"), chapSecrets)
	if err != nil {
		t.Fatal(err)
	}
	fr := &fakeRunner{fail: map[string]int{"--login": ISCSI_ERR_LOGIN_AUTH_FAILED}}
	tr := testTransport(t, fr)
	fr.nodes = tr.db.nodes
	err = tr.login(context.Background(), v, path{Portal: v.Portals[0], IP: "10.0.0.1"})
	if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "CHAP authentication failed") {
		t.Fatalf("got %v", err)
	}
	last := strings.Join(fr.argv[len(fr.argv)-1], " ")
	if !strings.Contains(last, "-o delete") {
		t.Fatalf("record not deleted after failed login: %q", fr.argv)
	}
}

func TestArgv(t *testing.T) {
	got := strings.Join(argsNodeNew(testIQN, "fd00::1", 3260, 2, "default"), " ")
	want := "-m node -o new -T " + testIQN + " -p [fd00::1]:3260,2 -I default"
	if got != want {
		t.Fatalf("got %q want %q", got, want)
	}
	if got := strings.Join(argsSessionLogout(7), " "); got != "-m session -r 7 -u" {
		t.Fatal(got)
	}
	if got := strings.Join(argsDiscover("10.0.0.1", 3260, "default"), " "); got != "-m discoverydb -t sendtargets -p 10.0.0.1:3260 -I default --discover -o nonpersistent" {
		t.Fatal(got)
	}
}

func TestParseDiscovery(t *testing.T) {
	out := "10.0.0.1:3260,1 iqn.2003-01.org.example:a\n[fd00::1]:3260,2 IQN.2003-01.org.example:A\ngarbage\n"
	d := parseDiscovery([]byte(out))
	if len(d) != 2 || d[0].IP != "10.0.0.1" || d[0].TPGT != 1 || d[1].IP != "fd00::1" || d[1].Target != "iqn.2003-01.org.example:a" {
		t.Fatalf("%+v", d)
	}
}

// TestInflightRemoval: a removal that outlives its caller's deadline keeps
// running once; the caller gets Unavailable at its deadline, and a retry
// joins the same removal instead of starting another.
func TestInflightRemoval(t *testing.T) {
	var in inflight
	key, what := "session3/0:0:0:1", "SCSI device 0:0:0:1 of session 3"
	release := make(chan struct{})
	var calls atomic.Int32
	fn := func(ctx context.Context) error {
		calls.Add(1)
		<-release
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := in.remove(ctx, key, what, fn)
	if !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Fatalf("first call: %v after %v", err, time.Since(start))
	}
	done := make(chan error, 1)
	go func() { done <- in.remove(context.Background(), key, what, fn) }()
	time.Sleep(20 * time.Millisecond)
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("retry: %v", err)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("removal ran %d times, want once", n)
	}
}

// iscsiadm creates the record (-o new: iscsid.conf's node.* settings), and
// berth writes its settings and the secrets into it in place: two iscsiadm
// runs, neither with a secret in its arguments; a failed login has
// iscsiadm delete the record again, secrets and all.
func TestLoginRecordByIscsiadm(t *testing.T) {
	v, err := ParseVolume(ctxWith("sessionCHAPAuth", "true"), chapSecrets)
	if err != nil {
		t.Fatal(err)
	}
	fr := &fakeRunner{}
	tr := testTransport(t, fr)
	fr.nodes = tr.db.nodes
	if err := tr.login(context.Background(), v, path{Portal: v.Portals[0], IP: "10.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	if len(fr.argv) != 2 || !slices.Contains(fr.argv[0], "new") || !slices.Contains(fr.argv[1], "--login") {
		t.Fatalf("want iscsiadm -o new, then the login; got %q", fr.argv)
	}
	files, err := tr.db.nodeRecordFiles(testIQN, "10.0.0.1", 3260, "default")
	if err != nil || len(files) != 1 {
		t.Fatalf("record files = %q, %v", files, err)
	}
	b, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	rec := parseRecord(b)
	for k, want := range map[string]string{
		"node.session.scan": "manual", "node.startup": "manual",
		SecretSessionPassword: "s3cret-Passw0rd", ParamReplacementTimeout: "20",
	} {
		if rec[k] != want {
			t.Errorf("record %s = %q, want %q", k, rec[k], want)
		}
	}
	if st, err := os.Stat(files[0]); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("record mode %v (%v), want 0600: it holds the secret", st.Mode().Perm(), err)
	}
}

// A failed login leaves no record behind, secrets included, and the
// attach leaves no lock file of the path in open-iscsi's lock directory.
func TestLoginFailureRemovesRecord(t *testing.T) {
	v, err := ParseVolume(ctxWith("sessionCHAPAuth", "true"), chapSecrets)
	if err != nil {
		t.Fatal(err)
	}
	fr := &fakeRunner{fail: map[string]int{"--login": ISCSI_ERR_LOGIN_AUTH_FAILED}}
	tr := testTransport(t, fr)
	fr.nodes = tr.db.nodes
	_, err = tr.attachPath(context.Background(), v, path{Portal: v.Portals[0], IP: "10.0.0.1"}, nil)
	if err == nil || !strings.Contains(err.Error(), "CHAP authentication failed") {
		t.Fatalf("got %v, want the CHAP failure", err)
	}
	if files, _ := tr.db.nodeRecordFiles(testIQN, "10.0.0.1", 3260, "default"); len(files) != 0 {
		t.Fatalf("records left after the failed login: %q", files)
	}
	ents, err := os.ReadDir(tr.db.walks.dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "berth.path.") {
			t.Errorf("the path's lock file %s is left after the failed login", e.Name())
		}
	}
}

// TestDetachNeverAttached: a volume whose stage failed before any login
// (iscsi_tcp not loaded, say) has no session and no node record; its
// Detach succeeds without iscsiadm, which may be missing on such a node.
func TestDetachNeverAttached(t *testing.T) {
	v, err := ParseVolume(ctxWith(), nil)
	if err != nil {
		t.Fatal(err)
	}
	fr := &fakeRunner{fail: map[string]int{"": ISCSI_ERR_INTERNAL}}
	tr := testTransport(t, fr)
	fr.nodes = tr.db.nodes
	if err := os.MkdirAll(tr.db.nodes, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := (&Target{t: tr, v: v}).Detach(context.Background(), nil); err != nil {
		t.Fatalf("Detach of a target never logged in to: %v", err)
	}
	if len(fr.argv) != 0 {
		t.Fatalf("Detach ran iscsiadm with nothing to undo: %q", fr.argv)
	}
}

func TestChangesRecords(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want bool
	}{
		{argsNodeNew("iqn.x", "10.0.0.1", 3260, 1, "default"), true},
		{argsNodeDelete("iqn.x", "10.0.0.1", 3260, "default"), true},
		{argsDiscoveryNew("10.0.0.1", 3260, "default"), true},
		{argsDiscoveryDelete("10.0.0.1", 3260), true},
		{argsDiscover("10.0.0.1", 3260, "default"), true},
		{argsNodeLogin("iqn.x", "10.0.0.1", 3260, 1, "default"), false},
		{argsSessionLogout(3), false},
		{[]string{"-m", "node", "-o", "show"}, false},
	} {
		if got := changesRecords(tc.args); got != tc.want {
			t.Errorf("changesRecords(%q) = %v, want %v", tc.args, got, tc.want)
		}
	}
}

// Every exit code that maps to a sentinel is named in the message: the
// sentinel is not printed, so its meaning must be.
func TestExitMeaningCoversSentinels(t *testing.T) {
	for code := 1; code <= ISCSI_ERR_CHILD_TERMINATED; code++ {
		if sentinelForExit(code) != nil && exitMeaning(code) == "" {
			t.Errorf("exit code %d maps to %v but has no meaning", code, sentinelForExit(code))
		}
	}
}

// TestRecordWalksAcrossTransports: two transports over one lock
// directory, as two berths on one node, each with a state directory of
// its own: one's login does not walk the node records while the other
// deletes a record. (The crash suite's runs at once, each a berth of its
// own, failed so: "iface iter could not stat".)
func TestRecordWalksAcrossTransports(t *testing.T) {
	dir := t.TempDir()
	db := &sharedRecords{changing: make(chan struct{})}
	tr := make([]*Transport, 2)
	for i := range tr {
		var err error
		tr[i], err = New(Options{NodeDir: filepath.Join(dir, "nodes"), LockDir: filepath.Join(dir, "lock"), Listener: &devices.Listener{}})
		if err != nil {
			t.Fatal(err)
		}
		rr := tr[i].run.(recordsRunner)
		rr.runner = sharedRecordsRunner{db}
		tr[i].run = rr
	}
	ctx := context.Background()
	deleted := make(chan error, 1)
	go func() {
		_, err := tr[0].run.run(ctx, "iscsiadm", argsNodeDelete("iqn.a", "10.0.0.1", 3260, "default")...)
		deleted <- err
	}()
	<-db.changing
	if _, err := tr[1].run.run(ctx, "iscsiadm", argsNodeLogin("iqn.b", "10.0.0.1", 3260, 1, "default")...); err != nil {
		t.Errorf("login: %v", err)
	}
	if err := <-deleted; err != nil {
		t.Errorf("delete: %v", err)
	}
}

// sharedRecords is open-iscsi's record database of one node as iscsiadm
// meets it: a command that walks the records while another changes them
// fails.
type sharedRecords struct {
	changes  atomic.Int32
	changing chan struct{} // closed when the first change starts
	once     sync.Once
}

type sharedRecordsRunner struct{ db *sharedRecords }

func (r sharedRecordsRunner) run(_ context.Context, name string, args ...string) ([]byte, error) {
	if changesRecords(args) {
		r.db.changes.Add(1)
		defer r.db.changes.Add(-1)
		r.db.once.Do(func() { close(r.db.changing) })
		// Long enough for a walk that does not wait to start.
		time.Sleep(100 * time.Millisecond)
		return nil, nil
	}
	if r.db.changes.Load() > 0 {
		return nil, fmt.Errorf("%s %q walked the node records while another command changed them: exit status 6, iface iter could not stat", name, args)
	}
	return nil, nil
}
