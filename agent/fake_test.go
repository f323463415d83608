package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/errdefs"
)

// fakeFS is an in-memory hostFS: mounts are map entries. It counts
// mounts so that tests can prove a volume is never mounted twice.
type fakeFS struct {
	mu     sync.Mutex
	mounts map[string]mountEntry
	nMount map[string]int // mount calls per target
	ro     map[string]bool
	roErr  error // returned by SetDeviceReadOnly(_, true) when set
}

var _ hostFS = (*fakeFS)(nil)

func newFakeFS() *fakeFS {
	return &fakeFS{mounts: make(map[string]mountEntry), nMount: make(map[string]int), ro: make(map[string]bool)}
}

func (f *fakeFS) SupportedFsTypes() []string { return []string{"ext4", "xfs"} }

func (f *fakeFS) ParseMountOptions(opts []string) (uintptr, string, error) {
	for _, o := range opts {
		if o == "errors=panic" {
			return 0, "", fmt.Errorf("mount option %q: refused: %w", o, errdefs.ErrInvalidArgument)
		}
	}
	return 0, "", nil
}

func (f *fakeFS) EnsureFilesystem(context.Context, string, string) (bool, error) { return true, nil }
func (f *fakeFS) Fsck(context.Context, string, string) error                     { return nil }

func (f *fakeFS) Mount(source, target, fsType string, _ uintptr, _ string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.mounts[target]; ok {
		f.nMount[target]++ // stacked: the bug the locks prevent
	}
	var maj, min int
	fmt.Sscanf(filepath.Base(source), "fake%d-%d", &maj, &min)
	f.mounts[target] = mountEntry{Major: maj, Minor: min, Source: source, FSType: fsType, Root: "/"}
	f.nMount[target]++
	return nil
}

func (f *fakeFS) BindMount(source, target string, _ bool, _ uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mounts[target] = mountEntry{Source: source}
	f.nMount[target]++
	return nil
}

func (f *fakeFS) Unmount(target string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.mounts, target)
	return nil
}

func (f *fakeFS) IsMountPoint(p string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.mounts[p]
	return ok, nil
}

func (f *fakeFS) MountInfo(p string) (mountEntry, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, ok := f.mounts[p]
	if !ok {
		return mountEntry{}, fmt.Errorf("mount at %s: %w", p, errdefs.ErrNotFound)
	}
	return m, nil
}

func (f *fakeFS) Resize(context.Context, string, string, string) error { return nil }
func (f *fakeFS) Stats(string) (fsStats, error)                        { return fsStats{TotalBytes: 1}, nil }
func (f *fakeFS) BlockDeviceSize(string) (int64, error)                { return 1 << 20, nil }
func (f *fakeFS) FlushBuffers(string) error                            { return nil }

func (f *fakeFS) SetDeviceReadOnly(devPath string, ro bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ro && f.roErr != nil {
		return f.roErr
	}
	f.ro[devPath] = ro
	return nil
}

func (f *fakeFS) DeviceReadOnly(devPath string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ro[devPath], nil
}

func (f *fakeFS) mountCount(target string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.nMount[target]
}

// fakeTransport serves volume_context "fake": <minor>. Attach of a target
// blocks while the transport's gate for it is closed.
type fakeTransport struct {
	mu       sync.Mutex
	gates    map[string]chan struct{}
	entered  chan string
	attached map[string]int
	grownTo  int64 // the size Expand reports when set
}

var _ Transport = (*fakeTransport)(nil)

func newFakeTransport() *fakeTransport {
	return &fakeTransport{gates: make(map[string]chan struct{}), entered: make(chan string, 100), attached: make(map[string]int)}
}

func (ft *fakeTransport) Name() string { return "fake" }

func (ft *fakeTransport) Parse(vc, _ map[string]string) (Target, error) {
	k := vc["fake"]
	if k == "" {
		return nil, invalid("volume_context[fake]: missing")
	}
	return &fakeTarget{ft: ft, key: k}, nil
}

// hold makes Attach of key wait until the returned function is called.
func (ft *fakeTransport) hold(key string) func() {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	ch := make(chan struct{})
	ft.gates[key] = ch
	return func() { close(ch) }
}

type fakeTarget struct {
	ft  *fakeTransport
	key string
}

func (t *fakeTarget) Key() string { return t.key }

func (t *fakeTarget) dev() *devices.Device {
	var minor uint32
	fmt.Sscanf(t.key, "%d", &minor)
	name := fmt.Sprintf("fake250-%d", minor)
	return &devices.Device{Name: name, Path: "/dev/" + name, Major: 250, Minor: minor, Size: 1 << 20, ID: devices.Identity{Kind: "fake", WWID: t.key}}
}

func (t *fakeTarget) Attach(ctx context.Context) (*devices.Device, error) {
	t.ft.entered <- t.key
	t.ft.mu.Lock()
	gate := t.ft.gates[t.key]
	t.ft.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	t.ft.mu.Lock()
	t.ft.attached[t.key]++
	t.ft.mu.Unlock()
	return t.dev(), nil
}

func (t *fakeTarget) Detach(context.Context) error { return nil }
func (t *fakeTarget) Expand(context.Context) (int64, error) {
	t.ft.mu.Lock()
	defer t.ft.mu.Unlock()
	if t.ft.grownTo > 0 {
		return t.ft.grownTo, nil
	}
	return 1 << 20, nil
}
func (t *fakeTarget) Health(context.Context) (bool, string) { return false, "" }

// newFakeAgent returns an agent on fakes: no root, no kernel.
func newFakeAgent(t *testing.T) (*Agent, *fakeFS, *fakeTransport) {
	t.Helper()
	st, err := openStore(filepath.Join(t.TempDir(), "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	host, tr := newFakeFS(), newFakeTransport()
	a := &Agent{
		cfg:        Config{NodeID: "fake-node", DriverName: DefaultDriverName},
		log:        slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		host:       host,
		state:      st,
		locks:      newInflight(),
		transports: map[string]Transport{"fake": tr},
		verify:     func(*devices.Device) error { return nil },
		lookup: func(name string) (*devices.Device, error) {
			var maj, min uint32
			if _, err := fmt.Sscanf(name, "fake%d-%d", &maj, &min); err != nil {
				return nil, os.ErrNotExist
			}
			return (&fakeTarget{key: fmt.Sprint(min)}).dev(), nil
		},
	}
	return a, host, tr
}
