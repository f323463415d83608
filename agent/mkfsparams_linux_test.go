package agent

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/berth-csi/berth/internal/testutil"
)

// superblockField is one line of dumpe2fs -h of the image, such as
// "Block size:" → "1024".
func superblockField(t *testing.T, image, field string) string {
	t.Helper()
	out, err := exec.Command("dumpe2fs", "-h", image).Output()
	if err != nil {
		t.Fatalf("dumpe2fs -h %s: %v", image, err)
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(field) + `:\s+(.*)$`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("dumpe2fs -h %s: no %q in\n%s", image, field, out)
	}
	return strings.TrimSpace(string(m[1]))
}

// The StorageClass's mkfs parameters shape the filesystem a stage makes,
// and only that one: a volume that has a filesystem is mounted as it is.
func TestStageMkfsParams(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts", "dumpe2fs", "xfs_info")
	h := newHarness(t)

	v := h.newVol("tuned", 64*mib, mountCap("ext4", snw))
	v.vctx["blockSize"] = "1024"
	v.vctx["inodeSize"] = "512"
	v.vctx["bytesPerInode"] = "4096"
	v.vctx["ext4ReservedBlocksPercent"] = "0"
	must(t, "stage", h.stage(v))
	must(t, "unstage", h.unstage(v))
	img := h.root + "/tuned.img"
	for field, want := range map[string]string{"Block size": "1024", "Inode size": "512", "Reserved block count": "0", "Inode count": "16384"} {
		if got := superblockField(t, img, field); got != want {
			t.Errorf("%s: %s, want %s", field, got, want)
		}
	}
	// Staged again with other parameters: the filesystem is kept.
	v.vctx["blockSize"] = "4096"
	v.vctx["ext4ReservedBlocksPercent"] = "10"
	must(t, "stage with other parameters", h.stage(v))
	must(t, "unstage", h.unstage(v))
	if got := superblockField(t, img, "Block size"); got != "1024" {
		t.Errorf("restaged with blockSize 4096: block size %s, want the 1024 it was made with", got)
	}

	x := h.newVol("tunedxfs", 300*mib, mountCap("xfs", snw))
	x.vctx["blockSize"] = "2048"
	x.vctx["inodeSize"] = "1024"
	must(t, "stage xfs", h.stage(x))
	out, err := exec.Command("xfs_info", x.staging).CombinedOutput()
	if err != nil {
		t.Fatalf("xfs_info: %v\n%s", err, out)
	}
	if !regexp.MustCompile(`isize=1024`).Match(out) || !regexp.MustCompile(`data\s+=\s+bsize=2048`).Match(out) {
		t.Errorf("xfs_info: want isize=1024 and data bsize=2048:\n%s", out)
	}
	must(t, "unstage xfs", h.unstage(x))

	// A bad value is refused before anything is done: no record, the
	// image still all zeros.
	for key, value := range map[string]string{"blockSize": "8192", "bytesPerInode": "x", "ext4ClusterSize": "65536"} {
		b := h.newVol("bad", 64*mib, mountCap("ext4", snw))
		b.vctx[key] = value
		err := h.stage(b)
		wantCode(t, "stage with "+key+"="+value, err, codes.InvalidArgument)
		if !strings.Contains(err.Error(), key) {
			t.Errorf("stage with %s=%s: %v does not name the key", key, value, err)
		}
		if _, ok := h.recordOf(b.id); ok {
			t.Errorf("refused stage left a record")
		}
		data, err := os.ReadFile(h.root + "/bad.img")
		if err != nil {
			t.Fatal(err)
		}
		if strings.Trim(string(data), "\x00") != "" {
			t.Errorf("refused stage wrote to the image")
		}
	}
	// xfs has no bytesPerInode.
	b := h.newVol("badxfs", 300*mib, &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: snw}})
	b.vctx["bytesPerInode"] = "8192"
	wantCode(t, "xfs with bytesPerInode", h.stage(b), codes.InvalidArgument)
}
