package iscsi

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/testutil"
)

// sessionRunner fakes iscsiadm for one session of testIQN in a fake
// sysfs tree: a logout takes the session out of the tree, and fails the
// test's check when a LUN was scanned into the session (its host's scan
// attribute written) since the tree was made; node records are played by
// fakeRunner.
type sessionRunner struct {
	fakeRunner
	sys sysTree

	mu        sync.Mutex
	logouts   int
	violation string
}

func (f *sessionRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !slices.Equal(args, argsSessionLogout(1)) {
		return f.fakeRunner.run(ctx, name, args...)
	}
	f.logouts++
	if b, _ := os.ReadFile(f.sys.root.Path("class", "scsi_host", "host2", "scan")); len(b) > 0 {
		f.violation = fmt.Sprintf("logged out of session 1 after %q was scanned into it", b)
	}
	return nil, os.Remove(f.sys.root.Path("class", "iscsi_session", "session1"))
}

// TestSessionLogoutAndScanTakeTurns: one berth's detach finds the session
// of its target through a portal without LUNs and logs out, while another
// attach, of the same berth or of a second berth on the node (its own
// state directory, the same open-iscsi lock directory), finds the session
// and scans its LUN into it. The session is the node's: a logout between
// the other's finding the session and its scan took the other's disk
// away with the session.
func TestSessionLogoutAndScanTakeTurns(t *testing.T) {
	testutil.RequireRoot(t, "netlink uevents")
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	for _, berths := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d berths", berths), func(t *testing.T) {
			// The tree: session 1 of testIQN through 10.0.0.1:3260
			// (host 2, target 0), logged in, without LUNs.
			sys := sampleSys(t)
			for _, p := range []string{"devices/platform/host2/session1/target2:0:0", "class/scsi_device"} {
				if err := os.RemoveAll(sys.root.Path(p)); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(sys.root.Path("class", "scsi_host", "host2", "scan"), nil, 0o600); err != nil {
				t.Fatal(err)
			}
			lockDir := filepath.Join(t.TempDir(), "lock")
			fr := &sessionRunner{sys: sys}
			tr := make([]*Transport, 2)
			for i := range tr {
				if i > 0 && berths == 1 {
					tr[i] = tr[0]
					continue
				}
				tr[i] = testTransport(t, fr)
				tr[i].sys = sys
				tr[i].db.lockDir = lockDir
				tr[i].db.walks = &recordWalks{dir: lockDir}
				tr[i].opts.Listener = l
			}
			fr.nodes = tr[0].db.nodes
			// The detach, with the session found without LUNs, waits
			// before its logout for the attach's scan, or for 300 ms:
			// the scan then falls between the two unless something
			// orders them.
			scanned := func() bool {
				b, _ := os.ReadFile(sys.root.Path("class", "scsi_host", "host2", "scan"))
				return len(b) > 0
			}
			attach := make(chan error, 1)
			tr[0].testHookLoggingOut = func() {
				v, err := ParseVolume(ctxWith("lun", "1"), nil)
				if err != nil {
					t.Error(err)
					return
				}
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
					defer cancel()
					_, err := tr[1].attachPath(ctx, v, path{Portal: v.Portals[0], IP: "10.0.0.1"}, nil)
					attach <- err
				}()
				for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end) && !scanned(); {
					time.Sleep(5 * time.Millisecond)
				}
			}
			v, err := ParseVolume(ctxWith("lun", "0"), nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := tr[0].detachPath(context.Background(), v, path{Portal: v.Portals[0], IP: "10.0.0.1"}); err != nil {
				t.Errorf("detach: %v", err)
			}
			// The attach finds no session after the logout, and the fake
			// iscsiadm logs in to none: it fails, and only the order
			// matters here.
			<-attach
			fr.mu.Lock()
			logouts, violation := fr.logouts, fr.violation
			fr.mu.Unlock()
			if logouts != 1 {
				t.Errorf("%d logouts, want the detach's 1", logouts)
			}
			if violation != "" {
				t.Errorf("the detach %s by another attach: the logout took that attach's LUN away", violation)
			}
			// The attach's unstage finds no session and deletes the
			// record: the path's lock file goes with it.
			v1, err := ParseVolume(ctxWith("lun", "1"), nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := tr[1].detachPath(context.Background(), v1, path{Portal: v1.Portals[0], IP: "10.0.0.1"}); err != nil {
				t.Errorf("detach of the attach's volume: %v", err)
			}
			if ents, _ := os.ReadDir(lockDir); slices.ContainsFunc(ents, func(e os.DirEntry) bool { return strings.HasPrefix(e.Name(), "berth.path.") }) {
				t.Errorf("the path's lock file is left after its session and its record are gone: %v", ents)
			}
		})
	}
}
