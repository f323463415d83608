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
)

// discoveryRunner fakes iscsiadm's discovery records: -o new creates a
// portal's record (st_config, without credentials) unless it exists,
// --discover answers only through a record that holds the discovery CHAP
// user (the target enforces discovery authentication), -o delete removes
// the record, and fails as iscsiadm does when there is none.
// second is closed at the second -o new.
type discoveryRunner struct {
	st string // the send_targets directory

	mu     sync.Mutex
	news   int
	second chan struct{}
}

func (f *discoveryRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	i := slices.Index(args, "-p")
	if i < 0 || !slices.Contains(args, "discoverydb") {
		return nil, nil
	}
	dir := filepath.Join(f.st, strings.Replace(args[i+1], ":", ",", 1))
	fail := func(code int) error { return exitError(name, args, code) }
	switch {
	case slices.Contains(args, "--discover"):
		b, err := os.ReadFile(filepath.Join(dir, "st_config"))
		if err != nil {
			return nil, fail(ISCSI_ERR_NO_OBJS_FOUND)
		}
		if !strings.Contains(string(b), SecretDiscoveryUsername+" = d\n") {
			return nil, fail(24) // login authentication failed
		}
		return []byte("10.0.0.1:3260,1 " + testIQN + "\n"), nil
	case slices.Contains(args, "new"):
		f.mu.Lock()
		if f.news++; f.news == 2 {
			close(f.second)
		}
		f.mu.Unlock()
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
		if _, err := os.Stat(filepath.Join(dir, "st_config")); err == nil {
			return nil, nil
		}
		return nil, os.WriteFile(filepath.Join(dir, "st_config"), []byte("discovery.sendtargets.auth.authmethod = None\n"), 0o600)
	case slices.Contains(args, "delete"):
		if _, err := os.Stat(dir); err != nil {
			return nil, fail(6) // "Discovery record [...] not found": a database error
		}
		if err := os.RemoveAll(dir); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// TestDiscoveriesThroughOnePortal: two volumes with discovery CHAP staged
// at once through one portal, by one berth or by two on the node, both
// find their target. The discovery record of a portal is one for the
// node: a discovery that deleted it under another one made that one fail
// (its credentials' edit found no record, or its discovery ran without
// credentials).
func TestDiscoveriesThroughOnePortal(t *testing.T) {
	secrets := map[string]string{SecretDiscoveryUsername: "d", SecretDiscoveryPassword: "dpass"}
	for _, berths := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d berths", berths), func(t *testing.T) {
			fr := &discoveryRunner{second: make(chan struct{})}
			// The first discovery to have its answer waits, before it
			// deletes its record, until a second one creates the
			// record, or for 300 ms: the second one's steps then fall
			// between the first one's unless something orders them.
			var once sync.Once
			hook := func() {
				once.Do(func() {
					select {
					case <-fr.second:
					case <-time.After(300 * time.Millisecond):
					}
				})
			}
			dir := t.TempDir()
			tr := make([]*Transport, 2)
			for i := range tr {
				if i > 0 && berths == 1 {
					tr[i] = tr[0]
					continue
				}
				var err error
				tr[i], err = New(Options{NodeDir: filepath.Join(dir, "nodes"), LockDir: filepath.Join(dir, "lock"), Listener: &devices.Listener{}})
				if err != nil {
					t.Fatal(err)
				}
				rr := tr[i].run.(recordsRunner)
				rr.runner = fr
				tr[i].run = rr
				tr[i].testHookDiscovered = hook
			}
			st, err := tr[0].db.sendTargetsDir()
			if err != nil {
				t.Fatal(err)
			}
			fr.st = st
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for i := range errs {
				v, err := ParseVolume(ctxWith("discoveryCHAPAuth", "true", "lun", []string{"1", "2"}[i]), secrets)
				if err != nil {
					t.Fatal(err)
				}
				wg.Go(func() {
					errs[i] = tr[i].discover(context.Background(), v, []path{{Portal: v.Portals[0], IP: "10.0.0.1"}})
				})
			}
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					t.Errorf("discovery of volume %d: %v", i, err)
				}
			}
			if ents, _ := os.ReadDir(st); len(ents) != 0 {
				t.Errorf("discovery records left: %v", ents)
			}
		})
	}
}
