package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// fakeFS is an in-memory hostFS: mounts are map entries. It counts
// mounts so that tests can prove a volume is never mounted twice.
type fakeFS struct {
	mu     sync.Mutex
	mounts map[string]mountEntry
	nMount map[string]int // mount calls per target
	ro     map[string]bool
	devDir string // where OpenDeviceNode makes its stand-ins
	roErr  error  // returned by SetDeviceReadOnly(_, true) when set
	// content is what each device holds: "" when blank, a filesystem
	// type, fakePartial, or any other name of foreign data.
	content map[string]string
	// uuids is the UUID of the filesystem each device holds, set by
	// each format; a filesystem put in content by a test has
	// "uuid-of-<device>".
	uuids map[string]string
	nMkfs int
	// mkfsHang, when set, makes a format write fakePartial and then wait
	// for it to close: a node that dies while mkfs runs. mkfsStarted
	// hears of each such format.
	mkfsHang    chan struct{}
	mkfsStarted chan string
	// mkfsErr, when set, makes a format write fakePartial and fail.
	mkfsErr error
	// mountErr, when set, makes Mount fail.
	mountErr error
	// dirtyJournal, when set, makes a Mount without noload or
	// norecovery fail as the kernel refuses a journal replay on a
	// read-only device. mountData lists each Mount's data.
	dirtyJournal bool
	mountData    []string
	// fscks counts Fsck calls.
	fscks int
	// unmountGate, when set, holds every Unmount until it is closed, as
	// an unmount's writeback waits for a device that queues I/O.
	unmountGate chan struct{}
	// unmountErr, when set, makes Unmount fail (a busy mount).
	unmountErr error
	// events lists "unmount <path>" and "flush <device>" in order.
	events []string
	// flushErr, when set, makes FlushBuffers fail.
	flushErr error
}

// fakePartial is what an interrupted mkfs leaves.
const fakePartial = "partial-mkfs"

// fakeDevSize is the size of every fake device, and fakeFSSize and
// fakeFSUsed are what a fake filesystem holds and uses of it.
const (
	fakeDevSize = 1 << 20
	fakeFSSize  = 960 << 10
	fakeFSUsed  = 64 << 10
)

// fakeDevice is the device at path. The fake's devices are named
// fake<major>-<minor>, as the fake transport's are; anything else at
// path is no block device (errdefs.ErrInvalidArgument), and nothing there
// is errdefs.ErrNotFound, as package fs answers.
func fakeDevice(path string) (major, minor int, err error) {
	name := filepath.Base(path)
	if _, err := fmt.Sscanf(name, "fake%d-%d", &major, &minor); err == nil && name == fmt.Sprintf("fake%d-%d", major, minor) {
		return major, minor, nil
	}
	if _, err := os.Lstat(path); err == nil {
		return 0, 0, fmt.Errorf("device %s: not a block device: %w", path, errdefs.ErrInvalidArgument)
	}
	return 0, 0, fmt.Errorf("device %s: no such device: %w", path, errdefs.ErrNotFound)
}

// checkFsType refuses a type package fs does not handle.
func (f *fakeFS) checkFsType(fsType string) error {
	if !slices.Contains(f.SupportedFsTypes(), fsType) {
		return fmt.Errorf("filesystem type %q: not supported: %w", fsType, errdefs.ErrInvalidArgument)
	}
	return nil
}

// checkDevice is fakeDevice's answer for a device that must be there.
func checkDevice(path string) error {
	_, _, err := fakeDevice(path)
	return err
}

// mountedDevice reports whether a filesystem of major:minor is mounted
// anywhere; the caller holds f.mu.
func (f *fakeFS) mountedDevice(major, minor int) bool {
	for _, m := range f.mounts {
		if m.Major == major && m.Minor == minor {
			return true
		}
	}
	return false
}

var _ hostFS = (*fakeFS)(nil)

// fakeRootIno is the inode of every fake filesystem's root.
const fakeRootIno = 2

func newFakeFS() *fakeFS {
	return &fakeFS{mounts: make(map[string]mountEntry), nMount: make(map[string]int), ro: make(map[string]bool),
		content: make(map[string]string), uuids: make(map[string]string), mkfsStarted: make(chan string, 10)}
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

func (f *fakeFS) EnsureFilesystem(_ context.Context, devPath, fsType string, _ fs.MkfsParams, _ func() (*os.File, int64, error), beforeMkfs func() error) (bool, error) {
	if err := f.checkFsType(fsType); err != nil {
		return false, err
	}
	if err := checkDevice(devPath); err != nil {
		return false, err
	}
	f.mu.Lock()
	switch c := f.content[devPath]; c {
	case fsType:
		f.mu.Unlock()
		return false, nil
	case "":
	default:
		f.mu.Unlock()
		return false, fmt.Errorf("format %s as %s: device holds %s: %w", devPath, fsType, c, errdefs.ErrFailedPrecondition)
	}
	f.mu.Unlock()
	if err := beforeMkfs(); err != nil {
		return false, err
	}
	if err := f.mkfs(devPath, fsType); err != nil {
		return false, err
	}
	return true, nil
}

func (f *fakeFS) Format(_ context.Context, devPath, fsType string, _ fs.MkfsParams) error {
	if err := f.checkFsType(fsType); err != nil {
		return err
	}
	maj, min, err := fakeDevice(devPath)
	if err != nil {
		return err
	}
	f.mu.Lock()
	mounted := f.mountedDevice(maj, min)
	f.mu.Unlock()
	if mounted {
		// mkfs refuses it: no sentinel, an Internal error.
		return fmt.Errorf("format %s as %s: mkfs.%s: %s is mounted; will not make a filesystem here", devPath, fsType, fsType, devPath)
	}
	return f.mkfs(devPath, fsType)
}

func (f *fakeFS) mkfs(devPath, fsType string) error {
	f.mu.Lock()
	if hang := f.mkfsHang; hang != nil {
		f.content[devPath] = fakePartial
		f.mu.Unlock()
		f.mkfsStarted <- devPath
		<-hang
		return fmt.Errorf("mkfs.%s %s: signal: killed", fsType, devPath)
	}
	if f.mkfsErr != nil {
		f.content[devPath] = fakePartial
		f.mu.Unlock()
		return f.mkfsErr
	}
	f.content[devPath] = fsType
	f.nMkfs++
	f.uuids[devPath] = fmt.Sprintf("uuid-%d", f.nMkfs)
	f.mu.Unlock()
	return nil
}

func (f *fakeFS) FilesystemUUID(devPath, fsType string) (string, error) {
	if err := f.checkFsType(fsType); err != nil {
		return "", err
	}
	if err := checkDevice(devPath); err != nil {
		return "", err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.content[devPath] != fsType {
		return "", fmt.Errorf("read filesystem UUID of %s: no %s superblock", devPath, fsType)
	}
	if u, ok := f.uuids[devPath]; ok {
		return u, nil
	}
	return "uuid-of-" + devPath, nil
}

// Fsck checks nothing: an xfs, a device in use and a clean ext4 pass,
// as in package fs.
func (f *fakeFS) Fsck(_ context.Context, devPath, fsType string) error {
	f.mu.Lock()
	f.fscks++
	f.mu.Unlock()
	if err := f.checkFsType(fsType); err != nil || fsType == "xfs" {
		return err
	}
	return checkDevice(devPath)
}

func (f *fakeFS) contentOf(devPath string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.content[devPath]
}

func (f *fakeFS) Mount(source string, target *fs.Handle, fsType string, _ uintptr, data string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.mountErr != nil {
		return f.mountErr
	}
	f.mountData = append(f.mountData, data)
	if f.dirtyJournal && !slices.ContainsFunc(strings.Split(data, ","), func(o string) bool { return o == "noload" || o == "norecovery" }) {
		return fmt.Errorf("mount %s: read-only file system: %w", source, fs.ErrRecoveryNeedsWrite)
	}
	maj, min, err := fakeDevice(source)
	if err != nil {
		return fmt.Errorf("mount %s: %w", source, err)
	}
	if c := f.content[source]; c != fsType {
		// The kernel's EINVAL: no sentinel, an Internal error.
		return fmt.Errorf("mount %s on %s (type %s): invalid argument (the device holds %q)", source, target.Path(), fsType, c)
	}
	p := target.Path()
	if m, ok := f.mounts[p]; ok {
		if m.Major == maj && m.Minor == min && m.Ino == fakeRootIno {
			// The kernel refuses the same filesystem on top of itself.
			return fmt.Errorf("mount %s on %s: already mounted there: %w", source, p, errdefs.ErrBusy)
		}
		f.nMount[p]++ // stacked: the bug the locks prevent
	}
	f.mounts[p] = mountEntry{Major: maj, Minor: min, FSType: fsType, Ino: fakeRootIno}
	f.nMount[p]++
	return nil
}

func (f *fakeFS) BindMount(source, target *fs.Handle, _ bool, _ uintptr) error {
	// package fs sets the bind's flags through the new mount, opened
	// again at target's name: a target from OpenPath has none.
	again, err := target.Reopen()
	if err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", source.Path(), target.Path(), err)
	}
	again.Close()
	f.mu.Lock()
	defer f.mu.Unlock()
	// A bind shows what is at source: a mounted filesystem's root, or
	// a device node (OpenDeviceNode's stand-in).
	m, ok := f.mounts[source.Path()]
	if !ok {
		m.RdevMajor, m.RdevMinor, _ = fakeDevice(source.Path())
	}
	f.mounts[target.Path()] = m
	f.nMount[target.Path()]++
	return nil
}

func (f *fakeFS) Unmount(dir *fs.Handle, name string, check func(mountEntry) error) error {
	f.mu.Lock()
	gate := f.unmountGate
	f.mu.Unlock()
	if gate != nil {
		<-gate
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	p := filepath.Join(dir.Path(), name)
	f.events = append(f.events, "unmount "+p)
	if f.unmountErr != nil {
		return f.unmountErr
	}
	m, ok := f.mounts[p]
	if !ok {
		return nil
	}
	if check != nil {
		if err := check(m); err != nil {
			return err
		}
	}
	for q := range f.mounts {
		if strings.HasPrefix(q, p+"/") {
			// A mount inside keeps it busy (EBUSY).
			return fmt.Errorf("unmount %s: %s is mounted inside: %w", p, q, errdefs.ErrBusy)
		}
	}
	delete(f.mounts, p)
	return nil
}

// OpenDeviceNode opens a stand-in file for the device node, made on
// first use in a directory of the test.
func (f *fakeFS) OpenDeviceNode(path string, major, minor uint32) (*fs.Handle, error) {
	maj, min, err := fakeDevice(path)
	if err != nil {
		return nil, fmt.Errorf("open device node: %w", err)
	}
	if uint32(maj) != major || uint32(min) != minor {
		return nil, fmt.Errorf("device node %s stands for device %d:%d, not %d:%d: %w", path, maj, min, major, minor, errdefs.ErrFailedPrecondition)
	}
	p := filepath.Join(f.devDir, filepath.Base(path))
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		return nil, err
	}
	return fs.OpenPath(p)
}

func (f *fakeFS) MountPoints(major, minor uint32) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for p, m := range f.mounts {
		if uint32(m.Major) == major && uint32(m.Minor) == minor {
			out = append(out, p)
		}
	}
	return out, nil
}

func (f *fakeFS) MountInfo(h *fs.Handle) (mountEntry, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, ok := f.mounts[h.Path()]
	if !ok {
		return mountEntry{}, fmt.Errorf("mount at %s: %w", h.Path(), errdefs.ErrNotFound)
	}
	return m, nil
}

// Trim trims the free space of a fake filesystem.
func (f *fakeFS) Trim(_ context.Context, h *fs.Handle) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if m, ok := f.mounts[h.Path()]; !ok || m.RdevMajor != 0 || m.RdevMinor != 0 {
		return 0, fmt.Errorf("trim %s: not the root of a mount: %w", h.Path(), errdefs.ErrInvalidArgument)
	}
	return fakeFSSize - fakeFSUsed, nil
}

// mounted reports whether the fake has a mount at p.
func (f *fakeFS) mounted(p string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.mounts[p]
	return ok
}

// Resize checks what package fs checks; a fake filesystem always fills
// its device already.
func (f *fakeFS) Resize(_ context.Context, devPath, mountPath, fsType string) error {
	if err := f.checkFsType(fsType); err != nil {
		return err
	}
	maj, min, err := fakeDevice(devPath)
	if err != nil {
		return err
	}
	if mountPath == "" {
		if fsType == "xfs" {
			return fmt.Errorf("resize %s: xfs grows only while mounted and no mount path was given: %w", devPath, errdefs.ErrInvalidArgument)
		}
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	m, ok := f.mounts[mountPath]
	switch {
	case !ok:
		return fmt.Errorf("resize %s: nothing is mounted at %s: %w", devPath, mountPath, errdefs.ErrNotFound)
	case m.Major != maj || m.Minor != min:
		return fmt.Errorf("resize %s: %s is a mount of device %d:%d: %w", devPath, mountPath, m.Major, m.Minor, errdefs.ErrFailedPrecondition)
	case m.FSType != fsType:
		return fmt.Errorf("resize %s: %s is mounted as %s, not %s: %w", devPath, mountPath, m.FSType, fsType, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// Stats describes a fake filesystem at the root of its mount; any other
// path is asked of the kernel, as package fs does.
func (f *fakeFS) Stats(path string) (fsStats, error) {
	f.mu.Lock()
	m, ok := f.mounts[path]
	f.mu.Unlock()
	if ok && m.RdevMajor == 0 && m.RdevMinor == 0 {
		return fsStats{
			TotalBytes: fakeFSSize, UsedBytes: fakeFSUsed, AvailableBytes: fakeFSSize - fakeFSUsed - fakeFSUsed,
			TotalInodes: 256, FreeInodes: 245, UsedInodes: 11,
		}, nil
	}
	s, err := fs.FilesystemStats(path)
	return fsStats(s), err
}

func (f *fakeFS) BlockDeviceSize(devPath string) (int64, error) {
	if err := checkDevice(devPath); err != nil {
		return 0, err
	}
	return fakeDevSize, nil
}

func (f *fakeFS) FlushBuffers(dev string) error {
	if err := checkDevice(dev); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, "flush "+dev)
	return f.flushErr
}

func (f *fakeFS) eventLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.events)
}

func (f *fakeFS) SetDeviceReadOnly(devPath string, ro bool) error {
	if err := checkDevice(devPath); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if ro && f.roErr != nil {
		return f.roErr
	}
	f.ro[devPath] = ro
	return nil
}

func (f *fakeFS) DeviceReadOnly(devPath string) (bool, error) {
	if err := checkDevice(devPath); err != nil {
		return false, err
	}
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
	detached map[string]int
	grownTo  int64 // the size Expand reports when set
	// unreachable keys answer StopQueueing with true, and log it in
	// host's events.
	unreachable map[string]bool
	stopped     map[string]int
	resumed     map[string]int // ResumeQueueing calls, also in host's events
	// pathsDown keys report their paths down in PathStates (an outage);
	// without it a target counts no paths.
	pathsDown map[string]bool
	host      *fakeFS
	// replaced maps a key to the WWID of the storage now behind it (a
	// LUN replaced on the target): Attach returns a device with it, and
	// so does the agent's lookup once the kernel has read it again.
	replaced map[string]string
	// replaceAtExpand, when set, is the WWID an Expand (a rescan) finds.
	replaceAtExpand string
	// kind, when set, is the Kind of the devices Attach returns (a
	// device of a network transport is fenced).
	kind string
}

// replacedWWID is the WWID the storage behind key has now, "" while it
// is the one first attached.
func (ft *fakeTransport) replacedWWID(key string) string {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	return ft.replaced[key]
}

var _ Transport = (*fakeTransport)(nil)

func newFakeTransport() *fakeTransport {
	return &fakeTransport{gates: make(map[string]chan struct{}), entered: make(chan string, 100), attached: make(map[string]int), detached: make(map[string]int),
		unreachable: make(map[string]bool), stopped: make(map[string]int), resumed: make(map[string]int), pathsDown: make(map[string]bool), replaced: make(map[string]string)}
}

func (ft *fakeTransport) Name() string { return "fake" }

func (ft *fakeTransport) Keys() []string { return []string{"fake"} }

func (ft *fakeTransport) Parse(vc, _ map[string]string) (Target, error) {
	k := vc["fake"]
	if k == "" {
		return nil, errdefs.InvalidArgument("volume_context[fake]: missing")
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

func (t *fakeTarget) Identity() (string, error) { return "fake " + t.key, nil }

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
	d := t.dev()
	if w := t.ft.replacedWWID(t.key); w != "" {
		d.ID.WWID = w
	}
	if t.ft.kind != "" {
		d.ID.Kind = t.ft.kind
	}
	return d, nil
}

func (t *fakeTarget) Preflight(context.Context) error { return nil }
func (t *fakeTarget) PathStates(context.Context) (map[string]int, error) {
	t.ft.mu.Lock()
	defer t.ft.mu.Unlock()
	down, counted := t.ft.pathsDown[t.key]
	switch {
	case !counted:
		return nil, nil
	case down:
		return map[string]int{"connecting": 2}, nil
	}
	return map[string]int{"live": 2}, nil
}
func (t *fakeTarget) StopQueueing(context.Context) (bool, error) {
	t.ft.mu.Lock()
	defer t.ft.mu.Unlock()
	t.ft.stopped[t.key]++
	if t.ft.host != nil && t.ft.unreachable[t.key] {
		t.ft.host.mu.Lock()
		t.ft.host.events = append(t.ft.host.events, "stop queueing "+t.key)
		t.ft.host.mu.Unlock()
	}
	return t.ft.unreachable[t.key], nil
}
func (t *fakeTarget) ResumeQueueing(context.Context) error {
	t.ft.mu.Lock()
	defer t.ft.mu.Unlock()
	t.ft.resumed[t.key]++
	if t.ft.host != nil {
		t.ft.host.mu.Lock()
		t.ft.host.events = append(t.ft.host.events, "resume queueing "+t.key)
		t.ft.host.mu.Unlock()
	}
	return nil
}
func (t *fakeTarget) Detach(context.Context, *devices.Recorded) error {
	t.ft.mu.Lock()
	t.ft.detached[t.key]++
	t.ft.mu.Unlock()
	return nil
}

func (t *fakeTarget) Expand(context.Context) (int64, error) {
	t.ft.mu.Lock()
	defer t.ft.mu.Unlock()
	if t.ft.replaceAtExpand != "" {
		t.ft.replaced[t.key] = t.ft.replaceAtExpand
	}
	if t.ft.grownTo > 0 {
		return t.ft.grownTo, nil
	}
	return 1 << 20, nil
}

func (t *fakeTarget) ExpandTo(ctx context.Context, minBytes int64) (int64, error) {
	size, err := t.Expand(ctx)
	if err == nil && size < minBytes {
		return size, fmt.Errorf("fake target: %d bytes, fewer than %d: %w", size, minBytes, errdefs.ErrUnavailable)
	}
	return size, err
}
func (t *fakeTarget) Health(context.Context) (bool, string) { return false, "" }

// newFakeAgent returns an agent on fakes: no root, no kernel.
func newFakeAgent(t *testing.T) (*Agent, *fakeFS, *fakeTransport) {
	t.Helper()
	stateDir := t.TempDir()
	st, err := openStore(filepath.Join(stateDir, "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	marks, err := openFSMarks(filepath.Join(stateDir, "filesystems"))
	if err != nil {
		t.Fatal(err)
	}
	host, tr := newFakeFS(), newFakeTransport()
	tr.host = host
	host.devDir = t.TempDir()
	a := &Agent{
		cfg:        Config{NodeID: "fake-node", DriverName: DefaultDriverName, StateDir: stateDir},
		log:        slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		host:       host,
		state:      st,
		marks:      marks,
		locks:      newInflight(),
		transports: map[string]Transport{"fake": tr},
		verify:     func(*devices.Device) error { return nil },
		lookup: func(name string) (*devices.Device, error) {
			var maj, min uint32
			if _, err := fmt.Sscanf(name, "fake%d-%d", &maj, &min); err != nil {
				return nil, os.ErrNotExist
			}
			d := (&fakeTarget{key: fmt.Sprint(min)}).dev()
			if w := tr.replacedWWID(fmt.Sprint(min)); w != "" {
				d.ID.WWID = w
			}
			return d, nil
		},
	}
	return a, host, tr
}

func (ft *fakeTransport) resumedCount(key string) int {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	return ft.resumed[key]
}
