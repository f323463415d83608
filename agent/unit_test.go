package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestCode(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{nil, codes.OK},
		{fmt.Errorf("volume_id: missing: %w", errdefs.ErrInvalidArgument), codes.InvalidArgument},
		{fmt.Errorf("image: %w", errdefs.ErrNotFound), codes.NotFound},
		{fmt.Errorf("x: %w", errdefs.ErrAlreadyExists), codes.AlreadyExists},
		{fmt.Errorf("x: %w", errdefs.ErrFailedPrecondition), codes.FailedPrecondition},
		{fmt.Errorf("x: %w", errdefs.ErrOutOfRange), codes.OutOfRange},
		{fmt.Errorf("x: %w", errdefs.ErrResourceExhausted), codes.ResourceExhausted},
		{fmt.Errorf("x: %w", errdefs.ErrBusy), codes.Aborted},
		{fmt.Errorf("x: %w", errdefs.ErrPermissionDenied), codes.PermissionDenied},
		{fmt.Errorf("x: %w", errdefs.ErrUnavailable), codes.Unavailable},
		{fmt.Errorf("x: %w", errdefs.ErrUnsupported), codes.FailedPrecondition},
		{fmt.Errorf("wait: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("wait: %w", ctx.Err()), codes.Canceled},
		// The request's problem wins over the cleanup's.
		{errors.Join(fmt.Errorf("a: %w", errdefs.ErrBusy), fmt.Errorf("b: %w", errdefs.ErrInvalidArgument)), codes.InvalidArgument},
		// A sentinel wins over a deadline that cut the cleanup short.
		{errors.Join(fmt.Errorf("a: %w", errdefs.ErrNotFound), context.DeadlineExceeded), codes.NotFound},
		{status.Error(codes.Unauthenticated, "x"), codes.Unauthenticated},
		{errors.New("mkfs crashed"), codes.Internal},
	} {
		if got := Code(tc.err); got != tc.want {
			t.Errorf("Code(%v) = %v, want %v", tc.err, got, tc.want)
		}
		if tc.err != nil {
			if got := status.Code(toStatus(tc.err, nil)); got != tc.want {
				t.Errorf("toStatus(%v) has code %v, want %v", tc.err, got, tc.want)
			}
		}
	}
}

func TestToStatusRedactsSecrets(t *testing.T) {
	err := toStatus(fmt.Errorf("login with chap secret hunter2 failed: %w", errdefs.ErrPermissionDenied), map[string]string{"password": "hunter2"})
	if strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("secret in error: %v", err)
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("code %v", status.Code(err))
	}
}

func TestValidatePath(t *testing.T) {
	for _, tc := range []struct {
		p  string
		ok bool
	}{
		{"/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv/mount", true},
		{"/a b/$(reboot);`id`", true}, // no shell anywhere: harmless
		{"", false},
		{"relative/path", false},
		{"/a/../etc", false},
		{"/a//b", false},
		{"/a/b/", false},
		{"/a/./b", false},
		{"/", false},
		{"/a\x00b", false},
		{"/a\nb", false},
		{"/a\x1b[31mb", false},
		{"/a\xffb", false},
		{"/" + strings.Repeat("a", 5000), false},
	} {
		err := validatePath("target_path", tc.p)
		if (err == nil) != tc.ok {
			t.Errorf("validatePath(%q) = %v, want ok=%t", tc.p, err, tc.ok)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("validatePath(%q) = %v, not ErrInvalidArgument", tc.p, err)
		}
		if err != nil && !strings.Contains(err.Error(), "target_path") {
			t.Errorf("validatePath(%q) = %v does not name the field", tc.p, err)
		}
	}
}

func TestHoldPath(t *testing.T) {
	dir := t.TempDir()
	must(t, "mkdir", os.Mkdir(filepath.Join(dir, "real"), 0o755))
	must(t, "symlink", os.Symlink(filepath.Join(dir, "real"), filepath.Join(dir, "link")))
	must(t, "symlink", os.Symlink("/etc", filepath.Join(dir, "real", "etc")))
	for _, tc := range []struct {
		p       string
		hold    error // holdPath
		openErr error // open of the name
	}{
		{filepath.Join(dir, "real", "target"), nil, errdefs.ErrNotFound},
		{filepath.Join(dir, "real"), nil, nil},
		{filepath.Join(dir, "link", "target"), errdefs.ErrInvalidArgument, nil},
		{filepath.Join(dir, "real", "etc"), nil, errdefs.ErrInvalidArgument},
		{filepath.Join(dir, "real", "etc", "x"), errdefs.ErrInvalidArgument, nil},
		{filepath.Join(dir, "missing", "target"), errdefs.ErrNotFound, nil},
	} {
		p, err := holdPath("target_path", tc.p)
		if (tc.hold == nil && err != nil) || (tc.hold != nil && !errors.Is(err, tc.hold)) {
			t.Errorf("holdPath(%q) = %v, want %v", tc.p, err, tc.hold)
		}
		if err != nil {
			continue
		}
		h, err := p.open()
		if (tc.openErr == nil && err != nil) || (tc.openErr != nil && !errors.Is(err, tc.openErr)) {
			t.Errorf("open %q = %v, want %v", tc.p, err, tc.openErr)
		}
		if h != nil {
			h.Close()
		}
		p.close()
	}
}

func TestValidateVolumeID(t *testing.T) {
	for id, ok := range map[string]bool{
		"pvc-1234":               true,
		"../../etc":              true, // opaque, never a path
		"":                       false,
		strings.Repeat("x", 129): false,
		"a\nb":                   false,
		"\xff":                   false,
	} {
		if err := validateVolumeID(id); (err == nil) != ok {
			t.Errorf("validateVolumeID(%q) = %v, want ok=%t", id, err, ok)
		}
	}
}

func TestValidateCapability(t *testing.T) {
	fsTypes := []string{"ext4", "xfs"}
	parse := newFakeFS().ParseMountOptions
	mnt := func(fs string, mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
		return mountCap(fs, mode, flags...)
	}
	for _, tc := range []struct {
		name string
		c    *csi.VolumeCapability
		ok   bool
		ro   bool
	}{
		{"default fs", mnt("", snw), true, false},
		{"xfs", mnt("xfs", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), true, false},
		{"single node multi writer", mnt("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER), true, false},
		{"reader only", mnt("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY), true, true},
		{"multi node reader only", mnt("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY), true, true},
		{"multi writer mount", mnt("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), false, false},
		{"multi node single writer mount", mnt("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER), false, false},
		{"multi writer block", blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), true, false},
		{"unknown mode", mnt("ext4", csi.VolumeCapability_AccessMode_UNKNOWN), false, false},
		{"btrfs", mnt("btrfs", snw), false, false},
		{"refused option", mnt("ext4", snw, "errors=panic"), false, false},
		{"control char option", mnt("ext4", snw, "noatime\n"), false, false},
		{"nil", nil, false, false},
		{"no access type", &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: snw}}, false, false},
		{"mount group", &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{VolumeMountGroup: "1000"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: snw},
		}, false, false},
	} {
		vc, err := validateCapability(tc.c, fsTypes, parse)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok=%t", tc.name, err, tc.ok)
			continue
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v is not ErrInvalidArgument", tc.name, err)
		}
		if err == nil && vc.readOnly() != tc.ro {
			t.Errorf("%s: readOnly %t, want %t", tc.name, vc.readOnly(), tc.ro)
		}
		if err == nil && !vc.Block && vc.FsType == "" {
			t.Errorf("%s: fs type not defaulted", tc.name)
		}
	}
}

// testImplied is what berth serve's transports declare: keys and the
// transport they select.
var testImplied = map[string]string{"file": "file", "nqn": "nvmeof", "targetTrAddr": "nvmeof", "iqn": "iscsi", "targetPortal": "iscsi"}

func TestTransportName(t *testing.T) {
	for _, tc := range []struct {
		vc   map[string]string
		want string
	}{
		{map[string]string{"file": "a.img"}, "file"},
		{map[string]string{"nqn": "nqn.2014-08.org:x", "targetTrAddr": "10.0.0.1"}, "nvmeof"},
		{map[string]string{"iqn": "iqn.2003-01.org:x", "targetPortal": "10.0.0.1:3260"}, "iscsi"},
		{map[string]string{"transport": "iscsi", "file": "a.img"}, "iscsi"},
		{map[string]string{"nqn": "x", "iqn": "y"}, ""},
		{map[string]string{"transport": ""}, ""},
		{map[string]string{"other": "x"}, ""},
		{nil, ""},
	} {
		got, err := transportName(tc.vc, testImplied)
		if got != tc.want || (tc.want == "") != (err != nil) {
			t.Errorf("transportName(%v) = %q, %v; want %q", tc.vc, got, err, tc.want)
		}
	}
}

// The transports' declared keys select them; a transport declared but not
// served is refused by name, one never declared as naming none.
func TestSelectTransport(t *testing.T) {
	fake := newFakeTransport()
	implied, err := impliedTransports([]Transport{fake}, []TransportKind{{Name: "iscsi", Keys: []string{"iqn", "targetPortal"}}})
	must(t, "impliedTransports", err)
	ts := map[string]Transport{"fake": fake}
	if tr, err := selectTransport(map[string]string{"fake": "1"}, implied, ts); err != nil || tr != Transport(fake) {
		t.Fatalf("fake key: %v, %v", tr, err)
	}
	for _, tc := range []struct {
		vc   map[string]string
		want string
	}{
		{map[string]string{"iqn": "iqn.2003-01.org:x"}, `volume_context: transport "iscsi" is not enabled on this node (enabled: [fake])`},
		{map[string]string{"transport": "nvmeof"}, `volume_context: transport "nvmeof" is not enabled on this node (enabled: [fake])`},
		{map[string]string{"fake": "1", "targetPortal": "p"}, `volume_context: keys of several transports [fake iscsi]; set "transport" to choose`},
		{map[string]string{"nqn": "x"}, `volume_context: names no transport (set "transport", or give a key that selects one: ["fake" "iqn" "targetPortal"])`},
	} {
		_, err := selectTransport(tc.vc, implied, ts)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), tc.want+":") {
			t.Errorf("selectTransport(%v) = %v, want %q", tc.vc, err, tc.want)
		}
	}
}

// Two transports with one name, or one key, are refused.
func TestImpliedTransportsConflicts(t *testing.T) {
	fake := newFakeTransport()
	for name, tc := range map[string]struct {
		enabled  []Transport
		disabled []TransportKind
	}{
		"enabled twice":         {[]Transport{fake, fake}, nil},
		"enabled and disabled":  {[]Transport{fake}, []TransportKind{{Name: "fake"}}},
		"key of two transports": {[]Transport{fake}, []TransportKind{{Name: "other", Keys: []string{"fake"}}}},
		"transport as a key":    {nil, []TransportKind{{Name: "other", Keys: []string{ContextTransport}}}},
		"empty key":             {nil, []TransportKind{{Name: "other", Keys: []string{""}}}},
		"kind without a name":   {nil, []TransportKind{{Keys: []string{"k"}}}},
	} {
		if m, err := impliedTransports(tc.enabled, tc.disabled); err == nil {
			t.Errorf("%s: accepted: %v", name, m)
		}
	}
}

func TestMergeContext(t *testing.T) {
	m, err := mergeContext(map[string]string{"file": "a"}, map[string]string{"extra": "b", "file": "a"})
	if err != nil || m["file"] != "a" || m["extra"] != "b" {
		t.Fatalf("merge: %v %v", m, err)
	}
	if _, err := mergeContext(map[string]string{"file": "a"}, map[string]string{"file": "b"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("conflicting keys: %v", err)
	}
	if _, err := mergeContext(map[string]string{"file": "a\x00"}, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("NUL in a value: %v", err)
	}
}

// Volume IDs never become paths: "../../etc" stays inside the state dir
// and comes back under its own ID.
func TestStateEncoding(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "volumes")
	s, err := openStore(dir)
	must(t, "openStore", err)
	ids := []string{"../../etc", "/", "a/b", ".", "..", "pvc-1", strings.Repeat("z", 128)}
	for _, id := range ids {
		must(t, "put", s.put(&volumeRecord{VolumeID: id, Transport: "file", Context: map[string]string{"file": "x"}, StagingPath: "/s/" + fmt.Sprint(len(id))}))
	}
	entries, err := os.ReadDir(dir)
	must(t, "readdir", err)
	if len(entries) != len(ids) {
		t.Fatalf("%d files for %d volumes", len(entries), len(ids))
	}
	for _, e := range entries {
		if !e.Type().IsRegular() || len(e.Name()) != 64+len(".json") {
			t.Fatalf("unexpected state entry %q", e.Name())
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "etc")); err == nil {
		t.Fatal("a volume ID escaped the state directory")
	}
	s2, err := openStore(dir)
	must(t, "reopen", err)
	for _, id := range ids {
		r, ok := s2.get(id)
		if !ok || r.VolumeID != id || r.Context["file"] != "x" {
			t.Fatalf("volume %q not reloaded: %+v", id, r)
		}
	}
	if owner, ok := s2.pathOwner("/s/9"); !ok || owner != "../../etc" {
		t.Fatalf("pathOwner: %q %t", owner, ok)
	}
	must(t, "remove", s2.remove("../../etc"))
	must(t, "remove twice", s2.remove("../../etc"))
	if _, ok := s2.get("../../etc"); ok {
		t.Fatal("removed record still there")
	}
	// A stale temporary file from a crash is cleaned, a misplaced record
	// refuses to load.
	must(t, "write tmp", os.WriteFile(filepath.Join(dir, ".tmp-x.json-1"), []byte("{"), 0o600))
	if _, err := openStore(dir); err != nil {
		t.Fatalf("open with a stale temp file: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".tmp-x.json-1")); err == nil {
		t.Fatal("stale temp file not removed")
	}
	must(t, "write misplaced", os.WriteFile(filepath.Join(dir, stateFileName("other")), []byte(`{"volumeID":"pvc-1"}`), 0o600))
	if _, err := openStore(dir); err == nil {
		t.Fatal("a record under another volume's file name was loaded")
	}
}

func TestStateClone(t *testing.T) {
	r := &volumeRecord{VolumeID: "v", Context: map[string]string{"a": "b"}, Publishes: map[string]publishRecord{"/t": {}}, Device: &deviceRecord{Name: "loop0"}}
	c := r.clone()
	c.Context["a"] = "x"
	c.Publishes["/u"] = publishRecord{}
	c.Device.Name = "loop1"
	if r.Context["a"] != "b" || len(r.Publishes) != 1 || r.Device.Name != "loop0" {
		t.Fatal("clone shares memory with the original")
	}
}

func TestWithoutSecrets(t *testing.T) {
	got := withoutSecrets(map[string]string{"file": "a", "password": "p", "copy": "s3cret"}, map[string]string{"password": "x", "chap": "s3cret"})
	if len(got) != 1 || got["file"] != "a" {
		t.Fatalf("withoutSecrets: %v", got)
	}
}

func TestStripSecrets(t *testing.T) {
	req := &csi.NodeStageVolumeRequest{
		VolumeId:      "v",
		Secrets:       map[string]string{"node.session.auth.password": "hunter2"},
		VolumeContext: map[string]string{"file": "a.img"},
	}
	s := stripSecrets(req).(*csi.NodeStageVolumeRequest)
	if s.Secrets["node.session.auth.password"] != strippedValue || s.VolumeContext["file"] != "a.img" {
		t.Fatalf("stripped: %v", s)
	}
	if req.Secrets["node.session.auth.password"] != "hunter2" {
		t.Fatal("stripSecrets changed the request")
	}

	// Through the interceptor at debug level: the request is logged,
	// the secret is not, and neither is it in the error.
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ic := logInterceptor(log)
	_, err := ic(context.Background(), req, &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Node/NodeStageVolume"}, func(ctx context.Context, _ any) (any, error) {
		return nil, toStatus(fmt.Errorf("login failed for hunter2: %w", errdefs.ErrPermissionDenied), req.Secrets)
	})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("interceptor changed the error: %v", err)
	}
	out := buf.String()
	if strings.Contains(out, "hunter2") {
		t.Fatalf("secret in the log:\n%s", out)
	}
	for _, want := range []string{`"volume_id":"v"`, "node.session.auth.password", `"code":"PermissionDenied"`} {
		if !strings.Contains(out, want) {
			t.Fatalf("log lacks %s:\n%s", want, out)
		}
	}
}

func TestSocketPath(t *testing.T) {
	for ep, want := range map[string]string{
		"unix:///run/berth/csi.sock": "/run/berth/csi.sock",
		"unix:/run/berth/csi.sock":   "/run/berth/csi.sock",
		"/run/berth/csi.sock":        "/run/berth/csi.sock",
		"tcp://127.0.0.1:10000":      "",
		"unix://relative.sock":       "",
		"unix:///run/../csi.sock":    "",
	} {
		got, err := SocketPath(ep)
		if got != want || (want == "") != (err != nil) {
			t.Errorf("SocketPath(%q) = %q, %v; want %q", ep, got, err, want)
		}
	}
}

// A missing staging path is reported by its own name, with the hint that
// the CO creates it, also when its parent is missing too.
func TestStageMissingStagingPath(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	dir := t.TempDir()
	for _, p := range []string{filepath.Join(dir, "vol1"), filepath.Join(dir, "stage", "vol1")} {
		_, err := n.NodeStageVolume(context.Background(), stageReq("vol1", p, "7"))
		if status.Code(err) != codes.NotFound {
			t.Fatalf("stage at missing %q: %v, want NotFound", p, err)
		}
		msg := status.Convert(err).Message()
		if !strings.Contains(msg, strconv.Quote(p)+": does not exist") || !strings.Contains(msg, "the CO creates it") || strings.Contains(msg, "parent") {
			t.Errorf("stage at missing %q: %q, want the path named as missing and the CO as its creator", p, msg)
		}
	}
}
