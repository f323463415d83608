package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/test/vm"
)

// TestVMBenchEncryption measures what LUKS2 costs on the node, against
// plain volumes in the same guest and the same run (make bench): the
// first stage of a blank 256 MiB ext4 file volume, plain and encrypted
// (with cryptsetup's argon2id at a fixed cost, and with pbkdf2 at its
// lowest, to tell the key derivation from the rest), and a sequential
// write of 128 MiB with O_DIRECT through the pod's path. It prints
// "BENCH encryption ..." lines.
//
//	BERTH_BENCH=1 go test -count=1 -run '^TestVMBenchEncryption$' -v ./agent/ | grep 'BENCH encryption'
func TestVMBenchEncryption(t *testing.T) {
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: runs with BERTH_BENCH=1 (make bench)")
	}
	vm.RunGuestTests(t,
		vm.WithTestRun("^TestBenchGuestEncryption$"),
		vm.WithModules("loop", "dm_crypt", "xts", "aesni_intel"),
		vm.WithMemory(2048),
		vm.WithEnv(map[string]string{"BERTH_BENCH": "1"}),
		vm.WithTimeout(20*time.Minute),
	)
}

func TestBenchGuestEncryption(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark")
	}
	h, _ := encHarness(t)
	secrets := map[string]string{SecretEncryptionPassphrase: "a long random secret for the bench"}
	const size, writeBytes, rounds = 256 * mib, 128 * mib, 3
	kinds := []struct {
		name string
		vctx map[string]string
	}{
		{"plain", nil},
		{"luks2-argon2id", map[string]string{ContextEncrypted: "true", ContextEncryptionPBKDFMemory: "65536", ContextEncryptionPBKDFIterations: "4"}},
		{"luks2-pbkdf2", map[string]string{ContextEncrypted: "true", ContextEncryptionPBKDF: "pbkdf2", ContextEncryptionPBKDFIterations: "1000"}},
	}
	stage := map[string][]time.Duration{}
	write := map[string][]float64{} // MiB/s
	for r := range rounds {
		for _, k := range kinds {
			v := h.newVol(fmt.Sprintf("%s-%d", k.name, r), size, mountCap("ext4", snw))
			for key, val := range k.vctx {
				v.vctx[key] = val
			}
			start := time.Now()
			_, err := h.node.NodeStageVolume(t.Context(), &csi.NodeStageVolumeRequest{
				VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx, Secrets: secrets})
			must(t, k.name+" stage", err)
			stage[k.name] = append(stage[k.name], time.Since(start))
			must(t, k.name+" publish", h.publish(v, false))
			mibs, err := directWrite(filepath.Join(v.target, "data"), writeBytes)
			must(t, k.name+" write", err)
			write[k.name] = append(write[k.name], mibs)
			must(t, k.name+" unpublish", h.unpublish(v))
			must(t, k.name+" unstage", h.unstage(v))
			must(t, "remove image", os.Remove(filepath.Join(h.root, v.vctx["file"])))
		}
	}
	med := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)/2]
	}
	medf := func(fs []float64) float64 {
		s := slices.Clone(fs)
		slices.Sort(s)
		return s[len(s)/2]
	}
	plainStage, plainWrite := med(stage["plain"]), medf(write["plain"])
	for _, k := range kinds {
		var ms []string
		for _, d := range stage[k.name] {
			ms = append(ms, fmt.Sprint(d.Milliseconds()))
		}
		t.Logf("BENCH encryption %s: first stage of a blank 256 MiB ext4 volume median %v (samples ms %s), %.2fx plain; sequential O_DIRECT write of 128 MiB median %.1f MiB/s, %.2fx plain",
			k.name, med(stage[k.name]).Round(time.Millisecond), strings.Join(ms, ","),
			float64(med(stage[k.name]))/float64(plainStage), medf(write[k.name]), medf(write[k.name])/plainWrite)
	}
}

// directWrite writes n bytes to a new file at p with O_DIRECT in 1 MiB
// blocks, syncs it, and returns the rate in MiB/s.
func directWrite(p string, n int) (float64, error) {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_DIRECT, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	// O_DIRECT wants an aligned buffer: a page-aligned slice of an mmap.
	buf, err := unix.Mmap(-1, 0, mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(buf)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	start := time.Now()
	for off := 0; off < n; off += mib {
		if _, err := f.Write(buf); err != nil {
			return 0, err
		}
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return float64(n) / mib / time.Since(start).Seconds(), nil
}
