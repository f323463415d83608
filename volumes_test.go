package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/internal/testutil"
)

// berth volumes, run beside a berth serve that has a volume staged and
// published, reports it and an unreadable record, in the table and in
// JSON, and leaves the serve and its state as they were.
func TestVolumesCommandBesideServe(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	sock, state, images := filepath.Join(dir, "csi.sock"), filepath.Join(dir, "state"), filepath.Join(dir, "images")
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pods", "mount")
	for _, d := range []string{images, staging, filepath.Dir(target)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(images, "a.img"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(images, "a.img"), 64<<20); err != nil {
		t.Fatal(err)
	}
	p := serveBerth(t, berthArgs(sock, state, "n", "--file-root="+images)...)
	mustServe(t, p, sock, "n")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vcap := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "vol-a", StagingTargetPath: staging, VolumeCapability: vcap, VolumeContext: map[string]string{"file": "a.img"}}); err != nil {
		t.Fatalf("stage: %v\n%s", err, p.out)
	}
	defer func() {
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "vol-a", StagingTargetPath: staging}); err != nil {
			t.Errorf("unstage: %v", err)
		}
		p.stop(t)
	}()
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "vol-a", StagingTargetPath: staging, TargetPath: target, VolumeCapability: vcap}); err != nil {
		t.Fatalf("publish: %v\n%s", err, p.out)
	}
	defer func() {
		if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "vol-a", TargetPath: target}); err != nil {
			t.Errorf("unpublish: %v", err)
		}
	}()
	sum := sha256.Sum256([]byte("vol-gone"))
	garbage := filepath.Join(state, "volumes", hex.EncodeToString(sum[:])+".json")
	if err := os.WriteFile(garbage, []byte("not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(garbage)

	volumes := func(extra ...string) []byte {
		t.Helper()
		args := append([]string{"volumes", "--state-dir=" + state, "--file-root=" + images, "--transports=nvmeof"}, extra...)
		out, err := exec.Command(berthBinary(t), args...).Output()
		if err != nil {
			t.Fatalf("berth %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	table := string(volumes())
	t.Logf("berth volumes:\n%s", table)
	for _, want := range []string{
		"VOLUME", "vol-a", "ext4", "mounted", "1/1",
		staging + ": ext4 7:", target + ": ext4 7:", "the volume's",
		"health   ok: ",
		"Records that cannot be read", garbage,
		"the records and the kernel DISAGREE",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("berth volumes: no %q in\n%s", want, table)
		}
	}

	var doc struct {
		Consistent bool `json:"consistent"`
		Volumes    []struct {
			VolumeID  string `json:"volumeID"`
			TargetKey string `json:"targetKey"`
			Device    struct {
				Path    string `json:"path"`
				Present bool   `json:"present"`
			} `json:"device"`
			Staging struct {
				ShowsVolume bool `json:"showsVolume"`
			} `json:"staging"`
			Publishes []struct {
				Path        string `json:"path"`
				ShowsVolume bool   `json:"showsVolume"`
			} `json:"publishes"`
			Usage struct {
				TotalBytes int64 `json:"totalBytes"`
			} `json:"usage"`
			Abnormal bool `json:"abnormal"`
		} `json:"volumes"`
		UnreadableRecords []struct {
			Path string `json:"path"`
		} `json:"unreadableRecords"`
	}
	if err := json.Unmarshal(volumes("--json"), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Consistent || len(doc.Volumes) != 1 || len(doc.UnreadableRecords) != 1 || doc.UnreadableRecords[0].Path != garbage {
		t.Fatalf("berth volumes --json: %+v", doc)
	}
	v := doc.Volumes[0]
	if v.VolumeID != "vol-a" || v.TargetKey != filepath.Join(images, "a.img") || !v.Device.Present || !v.Staging.ShowsVolume ||
		len(v.Publishes) != 1 || v.Publishes[0].Path != target || !v.Publishes[0].ShowsVolume || v.Usage.TotalBytes == 0 || v.Abnormal {
		t.Errorf("berth volumes --json: volume %+v", v)
	}

	// The serve still serves: it holds its lock, and its volume is as
	// it was.
	if _, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "vol-a", VolumePath: target}); err != nil {
		t.Errorf("NodeGetVolumeStats after berth volumes: %v", err)
	}
}
