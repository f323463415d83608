package agent

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Volumes, which the berth_volume_abnormal metric reads, reports the
// condition NodeGetVolumeStats reports: a publish target that lost its
// mount makes the volume abnormal in both.
func TestVolumesAbnormalLikeStats(t *testing.T) {
	a, host, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	ctx := context.Background()
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "s"), filepath.Join(dir, "pods", "t")
	must(t, "mkdir", mkdirAll(staging))
	must(t, "mkdir", mkdirAll(filepath.Dir(target)))
	_, err := n.NodeStageVolume(ctx, stageReq("vol-a", staging, "7"))
	must(t, "stage", err)
	_, err = n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: "vol-a", StagingTargetPath: staging, TargetPath: target, VolumeCapability: mountCap("ext4", snw),
	})
	must(t, "publish", err)

	check := func(want bool) {
		t.Helper()
		st, err := n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "vol-a", VolumePath: target})
		must(t, "stats", err)
		if got := st.GetVolumeCondition().GetAbnormal(); got != want {
			t.Fatalf("NodeGetVolumeStats abnormal = %v (%s), want %v", got, st.GetVolumeCondition().GetMessage(), want)
		}
		vs := a.Volumes(ctx)
		if len(vs) != 1 || vs[0].ID != "vol-a" {
			t.Fatalf("Volumes = %+v, want vol-a", vs)
		}
		if vs[0].Abnormal != want {
			t.Fatalf("Volumes abnormal = %v (%s), NodeGetVolumeStats says %v (%s)", vs[0].Abnormal, vs[0].Message, want, st.GetVolumeCondition().GetMessage())
		}
		if want && !strings.Contains(vs[0].Message, target) {
			t.Errorf("Volumes message %q does not name %s", vs[0].Message, target)
		}
	}
	check(false)
	// The pod's mount is gone (unmounted behind berth's back).
	host.mu.Lock()
	delete(host.mounts, target)
	host.mu.Unlock()
	check(true)
}
