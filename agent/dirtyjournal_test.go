package agent

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/fs"
)

// A reader-only volume whose filesystem's journal needs replaying, on a
// device that cannot be written (a snapshot of a volume in use), is
// mounted with noload (ext4) or norecovery (xfs) and without fsck; a
// writable volume never is.
func TestStageDirtyJournalReadOnly(t *testing.T) {
	for _, tc := range []struct {
		fsType, opt string
	}{{"ext4", "noload"}, {"xfs", "nouuid,norecovery"}} {
		t.Run(tc.fsType, func(t *testing.T) {
			a, host, _ := newFakeAgent(t)
			n := &nodeServer{a: a}
			dev := (&fakeTarget{key: "7"}).dev().Path
			host.content[dev] = tc.fsType
			host.ro[dev] = true
			host.dirtyJournal = true

			staging := filepath.Join(t.TempDir(), "staging")
			must(t, "mkdir", mkdirAll(staging))
			req := stageReq("vol-snap", staging, "7")
			req.VolumeCapability = mountCap(tc.fsType, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)
			if _, err := n.NodeStageVolume(context.Background(), req); err != nil {
				t.Fatalf("reader-only stage of a dirty %s: %v", tc.fsType, err)
			}
			if last := host.mountData[len(host.mountData)-1]; last != tc.opt {
				t.Errorf("mounted with %q, want %q", last, tc.opt)
			}
			if host.fscks != 0 {
				t.Errorf("fsck ran %d times on a read-only device", host.fscks)
			}
			if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "vol-snap", StagingTargetPath: staging}); err != nil {
				t.Fatal(err)
			}

			// The same device staged writable: the refusal stands, and no
			// mount skips the journal.
			host.mountData = nil
			req.VolumeId = "vol-rw"
			req.VolumeCapability = mountCap(tc.fsType, snw)
			_, err := n.NodeStageVolume(context.Background(), req)
			if err == nil {
				t.Fatal("writable stage of a dirty filesystem mounted it")
			}
			if slices.ContainsFunc(host.mountData, func(d string) bool { return d == tc.opt || d == "noload" }) {
				t.Errorf("writable stage tried %q", host.mountData)
			}
			if errors.Is(err, fs.ErrRecoveryNeedsWrite) {
				t.Logf("writable stage: %v", err)
			}
		})
	}
}
