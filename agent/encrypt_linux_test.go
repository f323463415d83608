package agent

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/internal/testutil"
)

// luksFormatImage writes a LUKS2 header to an image file (cryptsetup
// needs no device-mapper for that), with a cheap key derivation.
func luksFormatImage(t *testing.T, img string, passphrase string) {
	t.Helper()
	cmd := exec.Command("cryptsetup", "luksFormat", "--type", "luks2", "--batch-mode", "--key-file=-",
		"--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", img)
	cmd.Stdin = strings.NewReader(passphrase)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cryptsetup luksFormat: %v: %s", err, out)
	}
}

// unchanged checks that a failed call left an image as it was: same
// bytes, no loop device, no record.
func unchanged(t *testing.T, h *harness, img string, before []byte) {
	t.Helper()
	after, err := os.ReadFile(img)
	must(t, "read image", err)
	if !bytes.Equal(before, after) {
		t.Fatal("the refused stage changed the image's bytes")
	}
	if d, err := (devices.Roots{}).FindLoop(img); err == nil {
		t.Fatalf("refused stage left %s attached", d.Path)
	}
	if n := len(stateFiles(t, h)); n != 0 {
		t.Fatalf("refused stage left %d state files", n)
	}
}

// A LUKS volume staged without encrypted=true is refused, never
// formatted over, and the message says how to stage it.
func TestStageLUKSWithoutEncryptedRefused(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts", "cryptsetup")
	h := newHarness(t)
	for _, c := range []*csi.VolumeCapability{mountCap("ext4", snw), mountCap("xfs", snw)} {
		fsType := c.GetMount().GetFsType()
		v := h.newVol("luks-"+fsType, 320*mib, c)
		img := filepath.Join(h.root, v.vctx["file"])
		luksFormatImage(t, img, "correct horse battery staple")
		before, err := os.ReadFile(img)
		must(t, "read image", err)

		err = h.stage(v)
		wantCode(t, "stage a LUKS device without encrypted", err, codes.FailedPrecondition)
		msg := status.Convert(err).Message()
		for _, want := range []string{"crypto_LUKS", `encrypted="true"`, "encryptionPassphrase"} {
			if !strings.Contains(msg, want) {
				t.Errorf("message %q does not name %s", msg, want)
			}
		}
		if strings.Contains(msg, "wipefs") {
			t.Errorf("message %q advises erasing an encrypted volume", msg)
		}
		unchanged(t, h, img, before)
	}
}

// Bad encryption settings are refused before anything is attached.
func TestStageEncryptionBadRequests(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts")
	h := newHarness(t)
	v := h.newVol("bad-enc", 64*mib, mountCap("ext4", snw))
	img := filepath.Join(h.root, v.vctx["file"])
	before, err := os.ReadFile(img)
	must(t, "read image", err)
	good := map[string]string{SecretEncryptionPassphrase: "s3cret-passphrase"}
	for _, tc := range []struct {
		name    string
		vctx    map[string]string
		secrets map[string]string
	}{
		{"encrypted not a bool", map[string]string{"encrypted": "yes"}, good},
		{"no passphrase", map[string]string{"encrypted": "true"}, nil},
		{"empty passphrase", map[string]string{"encrypted": "true"}, map[string]string{SecretEncryptionPassphrase: ""}},
		{"weak cipher", map[string]string{"encrypted": "true", "encryptionCipher": "aes-cbc-plain"}, good},
		{"empty cipher", map[string]string{"encrypted": "true", "encryptionCipher": ""}, good},
		{"odd sector size", map[string]string{"encrypted": "true", "encryptionSectorSize": "333"}, good},
		{"sector size not a number", map[string]string{"encrypted": "true", "encryptionSectorSize": "4k"}, good},
		{"sector size 8192", map[string]string{"encrypted": "true", "encryptionSectorSize": "8192"}, good},
		{"unknown pbkdf", map[string]string{"encrypted": "true", "encryptionPBKDF": "scrypt"}, good},
		{"pbkdf2 memory", map[string]string{"encrypted": "true", "encryptionPBKDF": "pbkdf2", "encryptionPBKDFMemory": "65536"}, good},
		{"argon2 memory too small", map[string]string{"encrypted": "true", "encryptionPBKDFMemory": "8"}, good},
		{"argon2 iterations too few", map[string]string{"encrypted": "true", "encryptionPBKDFIterations": "2"}, good},
		{"allow discards not a bool", map[string]string{"encrypted": "true", "encryptionAllowDiscards": "yes"}, good},
		{"allow discards without encrypted", map[string]string{"encryptionAllowDiscards": "true"}, good},
		{"options without encrypted", map[string]string{"encryptionCipher": "aes-xts-plain64"}, good},
		{"options with encrypted false", map[string]string{"encrypted": "false", "encryptionSectorSize": "4096"}, good},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vctx := map[string]string{"file": v.vctx["file"]}
			for k, val := range tc.vctx {
				vctx[k] = val
			}
			_, err := h.node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
				VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: vctx, Secrets: tc.secrets,
			})
			wantCode(t, tc.name, err, codes.InvalidArgument)
			if p := tc.secrets[SecretEncryptionPassphrase]; p != "" && strings.Contains(err.Error(), p) {
				t.Fatalf("error %q holds the passphrase", err)
			}
			unchanged(t, h, img, before)
		})
	}
}

// A node without device-mapper refuses an encrypted stage as
// Unavailable with nothing changed: no header written, nothing attached.
// (Nodes with device-mapper run the encrypted stages in the VM tests.)
func TestStageEncryptedWithoutDeviceMapper(t *testing.T) {
	testutil.RequireRoot(t, "loop devices, mounts", "cryptsetup")
	if err := (devices.Roots{}).CheckDeviceMapper(); err == nil {
		t.Skip("device-mapper works here: the encrypted stages run (see the VM test TestVMEncryption)")
	}
	h := newHarness(t)
	v := h.newVol("no-dm", 64*mib, mountCap("ext4", snw))
	img := filepath.Join(h.root, v.vctx["file"])
	before, err := os.ReadFile(img)
	must(t, "read image", err)
	v.vctx["encrypted"] = "true"
	_, err = h.node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx,
		Secrets: map[string]string{SecretEncryptionPassphrase: "s3cret-passphrase"},
	})
	wantCode(t, "encrypted stage without device-mapper", err, codes.Unavailable)
	unchanged(t, h, img, before)
}
