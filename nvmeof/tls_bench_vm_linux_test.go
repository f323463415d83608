package nvmeof

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMBenchNVMeoFTLS measures what TLS costs an NVMe/TCP volume, against
// the same volume without TLS in the same guest and run (make bench): the
// attach of one path (berth's part of a stage: the key, the connect with
// its TLS handshakes for the admin and I/O queues, the namespace), and a
// sequential O_DIRECT write of 64 MiB to the namespace. Target and node
// share the guest (Debian 13's 6.12, tlshd 1.0.0) and its .nvme keyring:
// the target's key and berth's copy hold the same PSK. It prints
// "BENCH tls ..." lines.
//
//	BERTH_BENCH=1 go test -count=1 -run '^TestVMBenchNVMeoFTLS$' -v ./nvmeof/ | grep 'BENCH tls'
func TestVMBenchNVMeoFTLS(t *testing.T) {
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1 (make bench)")
	}
	vm.RunGuestTests(t, vm.WithKernel("trixie"), vm.WithTestRun("^TestBenchTLSGuest$"), vm.WithMemory(2048),
		vm.WithTimeout(15*time.Minute), vm.WithEnv(map[string]string{"BERTH_BENCH": "1"}))
}

func TestBenchTLSGuest(t *testing.T) {
	vm.RequireGuest(t)
	if os.Getenv("BERTH_BENCH") != "1" {
		t.Skip("benchmark: set BERTH_BENCH=1")
	}
	target.StartTLSHD(t)
	const rounds, writeBytes = 5, 64 << 20
	ns := []target.NVMeNamespace{{Size: writeBytes + 16<<20}}
	tlsSub := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:bench-tls", AllowedHosts: []string{tlsHostNQN},
		Namespaces: ns, Ports: []string{"127.0.0.1:4440"}, TLS: "required"})
	target.InsertTLSKey(t, tlsHostNQN, tlsSub.NQN(), tlsKey1)
	plainSub := target.NewNVMeTarget(t, target.NVMeConfig{NQN: "nqn.2026-01.io.berth:bench-plain", AllowedHosts: []string{tlsHostNQN},
		Namespaces: ns, Ports: []string{"127.0.0.1:4441"}})
	var logs bytes.Buffer
	var mu sync.Mutex
	tr := tlsTransport(t, &logs, &mu, tlsHostNQN, tlsHostID)
	kinds := []struct {
		name    string
		vc      map[string]string
		secrets map[string]string
	}{
		{"plain", map[string]string{"nqn": plainSub.NQN(), "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4441"}, nil},
		{"tls", map[string]string{"nqn": tlsSub.NQN(), "nsid": "1", "traddr": "127.0.0.1", "trsvcid": "4440", "tls": "true"},
			map[string]string{SecretTLSKey: tlsKey1}},
	}
	attach := map[string][]time.Duration{}
	write := map[string][]float64{}
	for range rounds {
		for _, k := range kinds {
			// A deadline for each attach, write and detach: a
			// 64 MiB write with TLS takes up to half a minute under
			// TCG, and ten of them outlast one.
			ctx := guestContext(t)
			tg, err := tr.Parse(k.vc, k.secrets)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			dev, err := tg.Attach(ctx)
			if err != nil {
				t.Fatalf("%s attach: %v", k.name, err)
			}
			attach[k.name] = append(attach[k.name], time.Since(start))
			mibs, err := directWriteDev(dev.Path, writeBytes)
			if err != nil {
				t.Fatalf("%s write: %v", k.name, err)
			}
			write[k.name] = append(write[k.name], mibs)
			if err := tg.Detach(ctx, nil); err != nil {
				t.Fatal(err)
			}
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
	for _, k := range kinds {
		var ms []string
		for _, d := range attach[k.name] {
			ms = append(ms, fmt.Sprint(d.Milliseconds()))
		}
		t.Logf("BENCH tls %s: attach of one path median %v (samples ms %s), %.2fx plain; sequential O_DIRECT write of 64 MiB median %.1f MiB/s, %.2fx plain",
			k.name, med(attach[k.name]).Round(time.Millisecond), strings.Join(ms, ","),
			float64(med(attach[k.name]))/float64(med(attach["plain"])), medf(write[k.name]), medf(write[k.name])/medf(write["plain"]))
	}
}

// directWriteDev writes n bytes to the block device at p with O_DIRECT
// in 1 MiB blocks, flushes it, and returns the rate in MiB/s.
func directWriteDev(p string, n int) (float64, error) {
	f, err := os.OpenFile(p, os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(buf)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	start := time.Now()
	for off := 0; off < n; off += len(buf) {
		if _, err := f.WriteAt(buf, int64(off)); err != nil {
			return 0, err
		}
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return float64(n) / (1 << 20) / time.Since(start).Seconds(), nil
}
