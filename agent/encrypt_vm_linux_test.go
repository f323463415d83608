package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/test/vm"
)

// TestVMEncryption boots a guest with dm-crypt and runs the encrypted
// volume tests (TestGuestEncryption*) there: the host has no
// device-mapper.
func TestVMEncryption(t *testing.T) {
	vm.RunGuestTests(t,
		vm.WithTestRun(guestEncRun()),
		vm.WithModules("loop", "dm_crypt", "xts", "aesni_intel"),
		vm.WithTimeout(20*time.Minute),
	)
}

// testPBKDF makes a key slot cheap to open under TCG, where argon2id
// costs seconds even with 32 MiB and 4 iterations (and cryptsetup's
// defaults 35 s to format, 10 s to open): pbkdf2 with 1000 iterations,
// which only tests may want. One volume below keeps argon2id.
var testPBKDF = map[string]string{ContextEncryptionPBKDF: "pbkdf2", ContextEncryptionPBKDFIterations: "1000"}

// argon2PBKDF is production's key derivation at a lower cost.
var argon2PBKDF = map[string]string{ContextEncryptionPBKDFMemory: "32768", ContextEncryptionPBKDFIterations: "4"}

// encHarness is a harness whose agent logs at debug level into logs too.
func encHarness(t *testing.T) (*harness, *lockedBuffer) {
	logs := &lockedBuffer{}
	h := newHarness(t, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(logs, testWriter{t}), &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	return h, logs
}

func encryptedVol(h *harness, name string, size int64, c *csi.VolumeCapability) vol {
	v := h.newVol(name, size, c)
	v.vctx[ContextEncrypted] = "true"
	for k, val := range testPBKDF {
		v.vctx[k] = val
	}
	return v
}

func stageWith(t *testing.T, h *harness, v vol, secrets map[string]string) error {
	_, err := twice(t, "NodeStageVolume", h.node.NodeStageVolume, &csi.NodeStageVolumeRequest{
		VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap, VolumeContext: v.vctx, Secrets: secrets,
	})
	return err
}

// procSampler reads the command line and environment of every process
// over and over, until stopped, and keeps those that hold secret.
type procSampler struct {
	secret   []byte
	stop     chan struct{}
	done     chan struct{}
	mu       sync.Mutex
	leaks    []string
	samples  int
	sawTools map[string]bool // cryptsetup, mkfs seen running
}

func sampleProcs(secret string) *procSampler {
	s := &procSampler{secret: []byte(secret), stop: make(chan struct{}), done: make(chan struct{}), sawTools: map[string]bool{}}
	go func() {
		defer close(s.done)
		for {
			select {
			case <-s.stop:
				return
			default:
			}
			ents, _ := os.ReadDir("/proc")
			for _, e := range ents {
				if e.Name()[0] < '0' || e.Name()[0] > '9' {
					continue
				}
				for _, f := range []string{"cmdline", "environ"} {
					b, err := os.ReadFile(filepath.Join("/proc", e.Name(), f))
					if err != nil {
						continue
					}
					s.mu.Lock()
					if bytes.Contains(b, s.secret) {
						s.leaks = append(s.leaks, e.Name()+"/"+f+": "+string(bytes.ReplaceAll(b, []byte{0}, []byte{' '})))
					}
					if f == "cmdline" {
						for _, tool := range []string{"cryptsetup", "mkfs"} {
							if bytes.Contains(b, []byte(tool)) {
								s.sawTools[tool] = true
							}
						}
					}
					s.mu.Unlock()
				}
			}
			s.mu.Lock()
			s.samples++
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *procSampler) check(t *testing.T) {
	t.Helper()
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	t.Logf("sampled every process's argv and environment %d times; saw %v", s.samples, s.sawTools)
	if len(s.leaks) > 0 {
		t.Fatalf("the passphrase showed in a process's argv or environment: %q", s.leaks)
	}
	if !s.sawTools["cryptsetup"] {
		t.Fatal("the sampler never saw cryptsetup run: the check proves nothing")
	}
}

// mappingOpen reports whether a device-mapper device of that name exists.
func mappingOpen(t *testing.T, name string) bool {
	t.Helper()
	ents, err := os.ReadDir("/sys/class/block")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/block", e.Name(), "dm", "name"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			return true
		}
	}
	return false
}

// wantClosed checks that nothing of v is left on the node: no mapping,
// no loop device, no record.
func wantClosed(t *testing.T, h *harness, v vol) {
	t.Helper()
	if mappingOpen(t, mappingName(v.id)) {
		t.Errorf("mapping %s still open", mappingName(v.id))
	}
	if d, err := (devices.Roots{}).FindLoop(filepath.Join(h.root, v.vctx["file"])); err == nil {
		t.Errorf("%s still attached as %s", v.vctx["file"], d.Path)
	}
	if _, ok := h.recordOf(v.id); ok {
		t.Errorf("volume %s still has a record", v.id)
	}
}

func fileSum(t *testing.T, p string) string {
	t.Helper()
	f, err := os.Open(p)
	must(t, "open "+p, err)
	defer f.Close()
	s := sha256.New()
	_, err = io.Copy(s, f)
	must(t, "read "+p, err)
	return hex.EncodeToString(s.Sum(nil))
}

// fileContains reads p in pieces (the guest's memory holds the images)
// and reports whether s occurs in it.
func fileContains(t *testing.T, p, s string) bool {
	t.Helper()
	f, err := os.Open(p)
	must(t, "open "+p, err)
	defer f.Close()
	buf := make([]byte, 1<<20+len(s))
	keep := 0
	for {
		n, err := f.Read(buf[keep:])
		if bytes.Contains(buf[:keep+n], []byte(s)) {
			return true
		}
		if err == io.EOF {
			return false
		}
		must(t, "read "+p, err)
		if k := keep + n; k >= len(s) {
			copy(buf, buf[k-len(s)+1:k])
			keep = len(s) - 1
		} else {
			keep = k
		}
	}
}

// marker is recognisable plaintext: 1 MiB of a random tag repeated.
func marker(t *testing.T) (tag string, data []byte) {
	b := make([]byte, 8)
	rand.Read(b)
	tag = "BERTH-PLAINTEXT-" + hex.EncodeToString(b) + "\n"
	return tag, bytes.Repeat([]byte(tag), (1<<20)/len(tag))
}

func TestGuestEncryption(t *testing.T) {
	vm.RequireGuest(t)
	h, logs := encHarness(t)
	const pass = "Tr0ub4dor&3-correct-horse-battery"
	secrets := map[string]string{SecretEncryptionPassphrase: pass}
	ctx := context.Background()

	t.Run("mount", func(t *testing.T) {
		// ext4 gets every check; xfs (300 MB at least, slow to read
		// through dm-crypt without KVM) the round trip and the
		// ciphertext check.
		for _, fsType := range []string{"ext4", "xfs"} {
			full, size := fsType == "ext4", int64(64*mib)
			if !full {
				size = 320 * mib
			}
			v := encryptedVol(h, "enc-"+fsType, size, mountCap(fsType, snw))
			if fsType == "ext4" {
				for k, val := range argon2PBKDF {
					v.vctx[k] = val
				}
				delete(v.vctx, ContextEncryptionPBKDF)
			}
			img := filepath.Join(h.root, v.vctx["file"])
			sampler := sampleProcs(pass)
			start := time.Now()
			must(t, "stage", stageWith(t, h, v, secrets))
			t.Logf("%s: first stage (luksFormat, open, mkfs, mount) in %v", fsType, time.Since(start).Round(time.Millisecond))
			sampler.check(t)
			rec, _ := h.recordOf(v.id)
			if rec.Crypt == nil || rec.Crypt.Mapping == nil || rec.Crypt.Formatting != nil {
				t.Fatalf("record after stage: %+v", rec.Crypt)
			}
			must(t, "publish", h.publish(v, false))
			tag, data := marker(t)
			must(t, "write", os.WriteFile(filepath.Join(v.target, "marker"), data, 0o644))
			f, _ := os.Open(filepath.Join(v.target, "marker"))
			must(t, "fsync", f.Sync())
			f.Close()
			st, err := h.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
			must(t, "stats", err)
			if st.GetVolumeCondition().GetAbnormal() || st.GetUsage()[0].GetUsed() < 1<<20 {
				t.Fatalf("stats: %v", st)
			}
			// The plaintext is readable on the mapping: the check
			// of the image below would find it if it were there.
			if full && !fileContains(t, rec.Crypt.Mapping.Path, tag) {
				t.Fatal("the marker is not on the mapping")
			}
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
			wantClosed(t, h, v)
			if fileContains(t, img, tag) {
				t.Fatal("the image holds the plaintext marker")
			}
			head := make([]byte, 6)
			f, err = os.Open(img)
			must(t, "open image", err)
			_, err = io.ReadFull(f, head)
			f.Close()
			must(t, "read image", err)
			if !bytes.Equal(head, []byte("LUKS\xba\xbe")) {
				t.Fatalf("the image does not start with a LUKS header: %q", head)
			}

			// Staged again: opened, not formatted; the data is there.
			must(t, "stage again", stageWith(t, h, v, secrets))
			must(t, "publish again", h.publish(v, false))
			got, err := os.ReadFile(filepath.Join(v.target, "marker"))
			must(t, "read back", err)
			if !bytes.Equal(got, data) {
				t.Fatal("data read back differs")
			}
			must(t, "unpublish", h.unpublish(v))
			must(t, "unstage", h.unstage(v))
			wantClosed(t, h, v)
			if !full {
				continue
			}

			// A wrong passphrase: refused, nothing open, image as it was.
			before := fileSum(t, img)
			err = stageWith(t, h, v, map[string]string{SecretEncryptionPassphrase: "wrong-" + pass})
			wantCode(t, "stage with a wrong passphrase", err, codes.PermissionDenied)
			t.Logf("wrong passphrase: %v", err)
			if strings.Contains(err.Error(), pass) {
				t.Fatal("the error holds the passphrase")
			}
			wantClosed(t, h, v)
			if fileSum(t, img) != before {
				t.Fatal("a stage with a wrong passphrase changed the image")
			}

			// Without encrypted: refused, never formatted over.
			plain := v
			plain.vctx = map[string]string{"file": v.vctx["file"]}
			err = h.stage(plain)
			wantCode(t, "stage a LUKS volume without encrypted", err, codes.FailedPrecondition)
			wantClosed(t, h, v)
			if fileSum(t, img) != before {
				t.Fatal("a stage without encrypted changed the image")
			}
		}
	})

	t.Run("block", func(t *testing.T) {
		v := encryptedVol(h, "enc-block", 64*mib, blockCap(snw))
		img := filepath.Join(h.root, v.vctx["file"])
		must(t, "stage", stageWith(t, h, v, secrets))
		must(t, "publish", h.publish(v, false))
		rec, _ := h.recordOf(v.id)
		st, err := os.Stat(v.target)
		must(t, "stat target", err)
		if st.Mode()&os.ModeDevice == 0 {
			t.Fatalf("target is %v, not a device node", st.Mode())
		}
		tag, data := marker(t)
		dev, err := os.OpenFile(v.target, os.O_RDWR|os.O_SYNC, 0)
		must(t, "open published device", err)
		_, err = dev.WriteAt(data, 0)
		must(t, "write", err)
		size, _ := dev.Seek(0, io.SeekEnd)
		dev.Close()
		if size != rec.Crypt.Mapping.Size || size >= 64*mib {
			t.Fatalf("published device has %d bytes; the mapping %d, the image %d", size, rec.Crypt.Mapping.Size, 64*mib)
		}
		must(t, "unpublish", h.unpublish(v))
		must(t, "unstage", h.unstage(v))
		wantClosed(t, h, v)
		if fileContains(t, img, tag) {
			t.Fatal("the image holds the plaintext marker")
		}
		must(t, "stage again", stageWith(t, h, v, secrets))
		must(t, "publish again", h.publish(v, false))
		dev, err = os.Open(v.target)
		must(t, "open published device", err)
		got := make([]byte, len(data))
		_, err = dev.ReadAt(got, 0)
		dev.Close()
		must(t, "read back", err)
		if !bytes.Equal(got, data) {
			t.Fatal("data read back differs")
		}
		must(t, "unpublish", h.unpublish(v))
		must(t, "unstage", h.unstage(v))
		wantClosed(t, h, v)
	})

	t.Run("expand", func(t *testing.T) {
		v := encryptedVol(h, "enc-grow", 64*mib, mountCap("ext4", snw))
		img := filepath.Join(h.root, v.vctx["file"])
		must(t, "stage", stageWith(t, h, v, secrets))
		must(t, "publish", h.publish(v, false))
		before := statTotal(t, h, v)
		must(t, "grow image", os.Truncate(img, 128*mib))
		req := &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 128 * mib}}
		// The volume key is in the kernel keyring: cryptsetup resize
		// needs the passphrase, and says so without it.
		_, err := h.node.NodeExpandVolume(ctx, req)
		wantCode(t, "expand without the passphrase", err, codes.FailedPrecondition)
		if !strings.Contains(err.Error(), "node_expand_secrets") {
			t.Fatalf("expand without the passphrase: %v does not say where to give it", err)
		}
		req.Secrets = secrets
		resp, err := h.node.NodeExpandVolume(ctx, req)
		must(t, "expand", err)
		after := statTotal(t, h, v)
		t.Logf("expanded: capacity %d, filesystem %d -> %d bytes", resp.GetCapacityBytes(), before, after)
		if after < before+48*mib {
			t.Fatalf("filesystem grew from %d to %d bytes only", before, after)
		}
		rec, _ := h.recordOf(v.id)
		if rec.Crypt.Mapping.Size < 100*mib {
			t.Fatalf("recorded mapping size %d after the expand", rec.Crypt.Mapping.Size)
		}
		must(t, "unpublish", h.unpublish(v))
		must(t, "unstage", h.unstage(v))
		wantClosed(t, h, v)
	})

	// A `cryptsetup open` that did not finish (its berth killed, a
	// restarted berth at the device meanwhile) may leave a device-mapper
	// device of the mapping's name without a
	// table: it maps nothing, and every open of the name failed with
	// "Device ... already exists" until someone removed it by hand.
	t.Run("unloaded mapping", func(t *testing.T) {
		dmsetup := func(args ...string) {
			t.Helper()
			if out, err := exec.Command("dmsetup", args...).CombinedOutput(); err != nil {
				t.Fatalf("dmsetup %q: %v: %s", args, err, out)
			}
		}
		v := encryptedVol(h, "enc-unloaded", 64*mib, mountCap("ext4", snw))
		name := mappingName(v.id)
		dmsetup("create", name, "--notable", "-u", "CRYPT-LUKS2-00000000000000000000000000000000-"+name)
		must(t, "stage over a mapping name without a table", stageWith(t, h, v, secrets))
		rec, _ := h.recordOf(v.id)
		if rec.Crypt == nil || rec.Crypt.Mapping == nil {
			t.Fatalf("record after stage: %+v", rec.Crypt)
		}
		must(t, "unstage", h.unstage(v))
		wantClosed(t, h, v)

		// One that is not a LUKS mapping of the volume's name is not
		// berth's to remove: the stage is refused and it stays.
		w := encryptedVol(h, "enc-foreign", 64*mib, mountCap("ext4", snw))
		other := mappingName(w.id)
		dmsetup("create", other, "--notable", "-u", "OTHER-"+other)
		t.Cleanup(func() { exec.Command("dmsetup", "remove", other).Run() })
		wantCode(t, "stage over another's device of the mapping's name", stageWith(t, h, w, secrets), codes.FailedPrecondition)
		// A device without a table has no block device in sysfs yet.
		if out, err := exec.Command("dmsetup", "info", other).CombinedOutput(); err != nil {
			t.Fatalf("the device %s berth does not own was removed: %v: %s", other, err, out)
		}
		h.unstage(w)
	})

	t.Run("logs", func(t *testing.T) {
		if strings.Contains(logs.String(), pass) {
			t.Fatal("berth's log holds the passphrase")
		}
		if !strings.Contains(logs.String(), "created LUKS2 header") {
			t.Fatal("the log check saw no encrypted stage")
		}
	})
}

// guestEncRun narrows the in-guest tests to BERTH_ENCRYPTION_RUN when it
// is set, to iterate on one of them.
func guestEncRun() string {
	if r := os.Getenv("BERTH_ENCRYPTION_RUN"); r != "" {
		return r
	}
	return "^TestGuestEncryption"
}

// An encrypted ext4 volume is checked before it is mounted, like a plain
// one: e2fsck runs on the mapping, where the filesystem is (the LUKS
// device under it is held by the mapping, so a check of it is skipped
// as "in use"). The filesystem is flagged as having errors between two
// stages (tune2fs -E force_fsck, as the kernel flags it after an I/O
// error); the second stage must have cleared the flag.
func TestGuestEncryptionFsck(t *testing.T) {
	vm.RequireGuest(t)
	h, _ := encHarness(t)
	const pass = "fsck-test passphrase"
	secrets := map[string]string{SecretEncryptionPassphrase: pass}
	v := encryptedVol(h, "enc-fsck", 64*mib, mountCap("ext4", snw))
	img := filepath.Join(h.root, v.vctx["file"])
	must(t, "stage", stageWith(t, h, v, secrets))
	must(t, "unstage", h.unstage(v))

	state := func(what string, edit ...string) string {
		t.Helper()
		loop := strings.TrimSpace(runOut(t, nil, "losetup", "--find", "--show", img))
		defer runOut(t, nil, "losetup", "-d", loop)
		const name = "enc-fsck-check"
		runOut(t, []byte(pass), "cryptsetup", "open", "--type", "luks2", "--key-file=-", loop, name)
		defer runOut(t, nil, "cryptsetup", "close", name)
		if len(edit) > 0 {
			runOut(t, nil, edit[0], append(edit[1:], "/dev/mapper/"+name)...)
		}
		for _, line := range strings.Split(runOut(t, nil, "dumpe2fs", "-h", "/dev/mapper/"+name), "\n") {
			if s, ok := strings.CutPrefix(line, "Filesystem state:"); ok {
				t.Logf("%s: filesystem state %q", what, strings.TrimSpace(s))
				return strings.TrimSpace(s)
			}
		}
		t.Fatalf("%s: dumpe2fs shows no filesystem state", what)
		return ""
	}
	if s := state("flagged", "tune2fs", "-E", "force_fsck"); !strings.Contains(s, "errors") {
		t.Fatalf("tune2fs -E force_fsck left the state %q", s)
	}
	must(t, "stage again", stageWith(t, h, v, secrets))
	must(t, "unstage again", h.unstage(v))
	wantClosed(t, h, v)
	if s := state("after the second stage"); strings.Contains(s, "errors") {
		t.Fatalf("the stage mounted the encrypted ext4 without checking it: state %q", s)
	}
}

// runOut runs a tool with stdin and returns its output; a failure fails
// t.
func runOut(t *testing.T, stdin []byte, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}
