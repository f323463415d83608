package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
)

// bigMap returns n entries named prefix-i whose values are valueLen bytes.
func bigMap(prefix string, n, valueLen int) map[string]string {
	m := make(map[string]string, n)
	for i := range n {
		v := fmt.Sprintf("%s-value-%d-", prefix, i)
		m[fmt.Sprintf("%s-%d", prefix, i)] = v + strings.Repeat("x", max(0, valueLen-len(v)))
	}
	return m
}

// A request whose maps or mount flags exceed berth's limits is refused
// with InvalidArgument naming the limit, before the volume is locked or
// anything is recorded, attached or mounted. The 25,000-entry case is the
// one that used to hold the volume's lock for 20 s and more.
func TestStageOverLimitsRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		edit   func(*csi.NodeStageVolumeRequest)
		fields []string // what the error must name
	}{
		{"25000 context entries and 25000 secrets", func(r *csi.NodeStageVolumeRequest) {
			for k, v := range bigMap("k", 25000, 60) {
				r.VolumeContext[k] = v
			}
			r.Secrets = bigMap("s", 25000, 60)
		}, []string{"volume_context", "entries", "128"}},
		{"volume_context entries", func(r *csi.NodeStageVolumeRequest) {
			for k, v := range bigMap("k", maxMapEntries, 8) {
				r.VolumeContext[k] = v
			}
		}, []string{"volume_context", "entries", "128"}},
		{"volume_context bytes", func(r *csi.NodeStageVolumeRequest) {
			for k, v := range bigMap("k", 20, maxContextLen) {
				r.VolumeContext[k] = v
			}
		}, []string{"volume_context", "bytes", "65536"}},
		{"publish_context entries", func(r *csi.NodeStageVolumeRequest) {
			r.PublishContext = bigMap("p", maxMapEntries+1, 8)
		}, []string{"publish_context", "entries", "128"}},
		{"secrets entries", func(r *csi.NodeStageVolumeRequest) {
			r.Secrets = bigMap("s", maxMapEntries+1, 8)
		}, []string{"secrets", "entries", "128"}},
		{"secrets bytes", func(r *csi.NodeStageVolumeRequest) {
			r.Secrets = bigMap("s", 3, maxMapBytes/2)
		}, []string{"secrets", "bytes", "65536"}},
		{"mount flags", func(r *csi.NodeStageVolumeRequest) {
			flags := make([]string, maxMountFlags+1)
			for i := range flags {
				flags[i] = "noatime"
			}
			r.VolumeCapability = mountCap("ext4", snw, flags...)
		}, []string{"mount_flags", "64"}},
		{"mount flag bytes", func(r *csi.NodeStageVolumeRequest) {
			flags := make([]string, 20)
			for i := range flags {
				flags[i] = "context=" + strings.Repeat("a", 250)
			}
			r.VolumeCapability = mountCap("ext4", snw, flags...)
		}, []string{"mount_flags", "bytes", "4096"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, host, tr := newFakeAgent(t)
			n := &nodeServer{a: a}
			staging := filepath.Join(t.TempDir(), "s")
			must(t, "mkdir", mkdirAll(staging))
			req := stageReq("vol", staging, "1")
			tc.edit(req)
			// The volume is locked by someone else: a request checked
			// before the lock is refused as invalid, not as busy.
			unlock, err := a.locks.tryLock(volumeKey("vol"))
			must(t, "lock", err)
			defer unlock()

			start := time.Now()
			_, err = n.NodeStageVolume(context.Background(), req)
			d := time.Since(start)
			t.Logf("refused in %v: %v", d, err)
			wantCode(t, "stage over the limits", err, codes.InvalidArgument)
			for _, f := range tc.fields {
				if !strings.Contains(status.Convert(err).Message(), f) {
					t.Errorf("error %q does not name %q", status.Convert(err).Message(), f)
				}
			}
			if a.state.count() != 0 || len(host.mounts) != 0 || len(tr.entered) != 0 {
				t.Fatalf("refused stage left %d records, %d mounts, %d attaches", a.state.count(), len(host.mounts), len(tr.entered))
			}
			// Generous: the refusal is a few milliseconds; the unbounded
			// request took tens of seconds.
			if d > 5*time.Second {
				t.Fatalf("refusal took %v", d)
			}
		})
	}
}

// The limits are generous: a request at every limit is staged, and its
// record keeps the context but no secret.
func TestStageAtLimitsAccepted(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	staging := filepath.Join(t.TempDir(), "s")
	must(t, "mkdir", mkdirAll(staging))
	req := stageReq("vol", staging, "1")
	// 128 entries in all, with "transport" and "fake"; just under 64 KiB.
	for k, v := range bigMap("k", maxMapEntries-2, maxMapBytes/maxMapEntries-8) {
		req.VolumeContext[k] = v
	}
	req.PublishContext = bigMap("p", maxMapEntries, maxMapBytes/maxMapEntries-8)
	req.Secrets = bigMap("s", maxMapEntries, maxMapBytes/maxMapEntries-8)
	// One secret also put into the context by mistake is not recorded.
	req.VolumeContext["k-0"] = req.Secrets["s-0"]
	flags := make([]string, maxMountFlags)
	for i := range flags {
		flags[i] = "noatime"
	}
	req.VolumeCapability = mountCap("ext4", snw, flags...)
	if got := mapBytes(req.VolumeContext); got > maxMapBytes {
		t.Fatalf("test request has %d bytes of volume_context", got)
	}
	_, err := n.NodeStageVolume(context.Background(), req)
	must(t, "stage at the limits", err)
	rec, ok := a.state.get("vol")
	if !ok {
		t.Fatal("no record")
	}
	if _, ok := rec.Context["k-0"]; ok {
		t.Fatal("a context entry whose value is a secret was recorded")
	}
	if len(rec.Context) != 2*maxMapEntries-1 {
		t.Fatalf("recorded %d context entries, want %d", len(rec.Context), 2*maxMapEntries-1)
	}
}

// withoutSecrets is linear: 50,000 context entries against 50,000
// secrets take milliseconds (a nested loop takes minutes).
func TestWithoutSecretsLinear(t *testing.T) {
	vc, secrets := bigMap("k", 50000, 20), bigMap("s", 50000, 20)
	vc["k-1"] = secrets["s-7"]
	vc["s-3"] = "not secret, but under a secret's key"
	start := time.Now()
	out := withoutSecrets(vc, secrets)
	d := time.Since(start)
	t.Logf("withoutSecrets of 50000 x 50000 entries: %v", d)
	if len(out) != len(vc)-2 {
		t.Fatalf("kept %d of %d entries, want %d", len(out), len(vc), len(vc)-2)
	}
	if d > 10*time.Second {
		t.Fatalf("took %v", d)
	}
}

// blockingDetach wraps the fake transport: the first Detach of each
// target blocks until its context ends (a logout or a loop release that
// does not come), later ones succeed at once.
type blockingDetach struct {
	*fakeTransport
	mu      sync.Mutex
	blocked map[string]bool
	calls   int
	stop    <-chan struct{} // closed when the test ends
}

func (b *blockingDetach) Parse(vc, secrets map[string]string) (Target, error) {
	t, err := b.fakeTransport.Parse(vc, secrets)
	if err != nil {
		return nil, err
	}
	return &blockingDetachTarget{Target: t, b: b}, nil
}

type blockingDetachTarget struct {
	Target
	b *blockingDetach
}

func (t *blockingDetachTarget) Detach(ctx context.Context, _ *devices.Recorded) error {
	t.b.mu.Lock()
	t.b.calls++
	first := !t.b.blocked[t.Key()]
	t.b.blocked[t.Key()] = true
	t.b.mu.Unlock()
	if !first {
		return nil
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.b.stop:
		return fmt.Errorf("test over")
	}
}

// fsckBlocks is the fake hostFS with a filesystem already on every
// device, whose fsck blocks until its context ends.
type fsckBlocks struct{ *fakeFS }

func (fsckBlocks) EnsureFilesystem(context.Context, string, string, fs.MkfsParams, func() (*os.File, int64, error), func() error) (bool, error) {
	return false, nil
}
func (fsckBlocks) FilesystemUUID(devPath, _ string) (string, error) {
	return "uuid-of-" + devPath, nil
}
func (fsckBlocks) Fsck(ctx context.Context, _, _ string) error {
	<-ctx.Done()
	return ctx.Err()
}

// A stage whose client deadline passes while a step blocks returns and
// releases the volume's lock promptly: an unstage right after it is not
// Aborted, and finishes what the stage left.
func TestStageDeadlineReleasesLock(t *testing.T) {
	const deadline = 500 * time.Millisecond
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, a *Agent, tr *fakeTransport, req *csi.NodeStageVolumeRequest, stop <-chan struct{})
	}{
		{"attach blocks", func(t *testing.T, a *Agent, tr *fakeTransport, req *csi.NodeStageVolumeRequest, stop <-chan struct{}) {
			t.Cleanup(tr.hold("1"))
		}},
		{"fsck blocks", func(t *testing.T, a *Agent, tr *fakeTransport, req *csi.NodeStageVolumeRequest, stop <-chan struct{}) {
			a.host = fsckBlocks{a.host.(*fakeFS)}
		}},
		{"attach and the undo's detach block", func(t *testing.T, a *Agent, tr *fakeTransport, req *csi.NodeStageVolumeRequest, stop <-chan struct{}) {
			t.Cleanup(tr.hold("1"))
			b := &blockingDetach{fakeTransport: tr, blocked: map[string]bool{}, stop: stop}
			a.transports["fake"] = b
			a.undoTimeout = deadline
			// The undo gave up and left the record; the unstage
			// detached from it.
			t.Cleanup(func() {
				b.mu.Lock()
				defer b.mu.Unlock()
				if b.calls != 2 {
					t.Errorf("%d detaches, want 2 (the undo's, the unstage's)", b.calls)
				}
			})
		}},
		{"25000 context entries and 25000 secrets", func(t *testing.T, a *Agent, tr *fakeTransport, req *csi.NodeStageVolumeRequest, stop <-chan struct{}) {
			for k, v := range bigMap("k", 25000, 60) {
				req.VolumeContext[k] = v
			}
			req.Secrets = bigMap("s", 25000, 60)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, _, tr := newFakeAgent(t)
			// Short: the socket path must fit in sun_path.
			dir, err := os.MkdirTemp("", "berth")
			must(t, "temp dir", err)
			t.Cleanup(func() { os.RemoveAll(dir) })
			staging := filepath.Join(dir, "s")
			must(t, "mkdir", mkdirAll(staging))
			req := stageReq("vol", staging, "1")
			stop := make(chan struct{})
			tc.setup(t, a, tr, req, stop)

			endpoint := "unix://" + filepath.Join(dir, "csi.sock")
			lis, err := Listen(endpoint)
			must(t, "Listen", err)
			a.cfg.ShutdownTimeout = time.Second
			sctx, cancel := context.WithCancel(context.Background())
			served := make(chan error, 1)
			go func() { served <- a.Serve(sctx, lis) }()
			t.Cleanup(func() { cancel(); <-served })
			// Before Serve waits for the calls in flight: a step still
			// blocked ends.
			t.Cleanup(func() { close(stop) })
			conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
			must(t, "dial", err)
			t.Cleanup(func() { conn.Close() })
			node := csi.NewNodeClient(conn)

			ctx, cancelCall := context.WithTimeout(context.Background(), deadline)
			defer cancelCall()
			start := time.Now()
			_, err = node.NodeStageVolume(ctx, req)
			if c := status.Code(err); c != codes.DeadlineExceeded && c != codes.InvalidArgument {
				t.Fatalf("stage: %v, want DeadlineExceeded or InvalidArgument", err)
			}
			t.Logf("stage: %v after %v", status.Code(err), time.Since(start))

			// The handler gets the cancellation when the client does;
			// give it a moment to return, never as long as the old 20 s.
			var uerr error
			for range 100 {
				_, uerr = node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging})
				if status.Code(uerr) != codes.Aborted {
					break
				}
				time.Sleep(30 * time.Millisecond)
			}
			must(t, "unstage after the stage's deadline", uerr)
			t.Logf("unstage done %v after the stage began", time.Since(start))
			if n := a.state.count(); n != 0 {
				t.Fatalf("%d records left after the unstage", n)
			}
		})
	}
}

// Publish and expand refuse secrets and mount flags beyond the limits
// before they take the volume's lock.
func TestPublishExpandOverLimitsRefused(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	unlock, err := a.locks.tryLock(volumeKey("vol"))
	must(t, "lock", err)
	defer unlock()
	flags := make([]string, maxMountFlags+1)
	for i := range flags {
		flags[i] = "noatime"
	}
	secrets := bigMap("s", maxMapEntries+1, 8)
	_, err = n.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: "vol", StagingTargetPath: "/s", TargetPath: "/t", VolumeCapability: mountCap("ext4", snw), Secrets: secrets,
	})
	wantCode(t, "publish with too many secrets", err, codes.InvalidArgument)
	_, err = n.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: "vol", StagingTargetPath: "/s", TargetPath: "/t", VolumeCapability: mountCap("ext4", snw, flags...),
	})
	wantCode(t, "publish with too many mount flags", err, codes.InvalidArgument)
	_, err = n.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: "/s", Secrets: secrets})
	wantCode(t, "expand with too many secrets", err, codes.InvalidArgument)
	_, err = n.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: "/s", VolumeCapability: mountCap("ext4", snw, flags...)})
	wantCode(t, "expand with too many mount flags", err, codes.InvalidArgument)
}

// An oversized request is not formatted whole into the debug log: the
// line names its size, and the refusal stays as cheap as the limits
// make it.
func TestDebugLogSkipsOversizedRequest(t *testing.T) {
	var buf strings.Builder
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	req := &csi.NodeStageVolumeRequest{VolumeId: "v", VolumeContext: bigMap("k", 25000, 60)}
	handler := func(context.Context, any) (any, error) {
		return nil, status.Error(codes.InvalidArgument, "over the limits")
	}
	_, _ = logInterceptor(log)(context.Background(), req, &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Node/NodeStageVolume"}, handler)
	out := buf.String()
	if strings.Contains(out, "k-24999") || len(out) > 4096 {
		t.Fatalf("the oversized request was logged whole (%d bytes of log)", len(out))
	}
	if !strings.Contains(out, "request_bytes=") {
		t.Fatalf("the debug line does not name the request's size:\n%s", out)
	}
	// A request of a normal size is still logged whole.
	buf.Reset()
	req = &csi.NodeStageVolumeRequest{VolumeId: "v", VolumeContext: map[string]string{"file": "vol.img"}}
	_, _ = logInterceptor(log)(context.Background(), req, &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Node/NodeStageVolume"}, handler)
	if !strings.Contains(buf.String(), "vol.img") {
		t.Fatalf("a small request is not logged whole:\n%s", buf.String())
	}
}
