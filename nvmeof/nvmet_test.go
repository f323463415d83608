package nvmeof

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// nvmetRoot is the kernel NVMe target's configfs tree (guest only).
const nvmetRoot = "/sys/kernel/config/nvmet"

// nvmetSubsys is an NVMe/TCP target subsystem in the guest's kernel,
// its namespaces backed by sparse files on tmpfs.
type nvmetSubsys struct {
	t   *testing.T
	nqn string
	dir string
}

func cfgWrite(t *testing.T, path, v string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(v), 0o644); err != nil {
		t.Fatalf("nvmet: write %q to %s: %v", v, path, err)
	}
}

// newNVMetSubsys creates subsystem nqn that allows any host.
func newNVMetSubsys(t *testing.T, nqn string) *nvmetSubsys {
	t.Helper()
	s := &nvmetSubsys{t: t, nqn: nqn, dir: filepath.Join(nvmetRoot, "subsystems", nqn)}
	if err := os.Mkdir(s.dir, 0o755); err != nil {
		t.Fatalf("nvmet: create subsystem: %v", err)
	}
	cfgWrite(t, filepath.Join(s.dir, "attr_allow_any_host"), "1")
	t.Cleanup(func() {
		ents, _ := os.ReadDir(filepath.Join(s.dir, "namespaces"))
		for _, e := range ents {
			ns := filepath.Join(s.dir, "namespaces", e.Name())
			os.WriteFile(filepath.Join(ns, "enable"), []byte("0"), 0)
			os.Remove(ns)
		}
		if err := os.Remove(s.dir); err != nil {
			t.Logf("nvmet: remove subsystem %s: %v", nqn, err)
		}
	})
	return s
}

// addNamespace adds namespace nsid of size bytes; uuid and nguid may be "".
func (s *nvmetSubsys) addNamespace(nsid uint32, size int64, uuid, nguid string) string {
	t := s.t
	t.Helper()
	file := filepath.Join(t.TempDir(), fmt.Sprintf("ns%d.img", nsid))
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	ns := filepath.Join(s.dir, "namespaces", strconv.FormatUint(uint64(nsid), 10))
	if err := os.Mkdir(ns, 0o755); err != nil {
		t.Fatalf("nvmet: create namespace: %v", err)
	}
	cfgWrite(t, filepath.Join(ns, "device_path"), file)
	cfgWrite(t, filepath.Join(ns, "buffered_io"), "1") // tmpfs has no O_DIRECT
	if uuid != "" {
		cfgWrite(t, filepath.Join(ns, "device_uuid"), uuid)
	}
	if nguid != "" {
		cfgWrite(t, filepath.Join(ns, "device_nguid"), nguid)
	}
	cfgWrite(t, filepath.Join(ns, "enable"), "1")
	return file
}

// resize grows the backing file of a namespace and tells the target,
// which announces the new size to hosts by AEN.
func (s *nvmetSubsys) resize(nsid uint32, file string, size int64) {
	t := s.t
	t.Helper()
	if err := os.Truncate(file, size); err != nil {
		t.Fatal(err)
	}
	cfgWrite(t, filepath.Join(s.dir, "namespaces", strconv.FormatUint(uint64(nsid), 10), "revalidate_size"), "1")
}

// nvmetPort is a TCP listener of the target.
type nvmetPort struct {
	t   *testing.T
	dir string
}

var nvmetPortSeq = 0

// newNVMetPort listens on 127.0.0.1:port.
func newNVMetPort(t *testing.T, port int) *nvmetPort {
	t.Helper()
	nvmetPortSeq++
	p := &nvmetPort{t: t, dir: filepath.Join(nvmetRoot, "ports", strconv.Itoa(nvmetPortSeq))}
	if err := os.Mkdir(p.dir, 0o755); err != nil {
		t.Fatalf("nvmet: create port: %v", err)
	}
	cfgWrite(t, filepath.Join(p.dir, "addr_trtype"), "tcp")
	cfgWrite(t, filepath.Join(p.dir, "addr_adrfam"), "ipv4")
	cfgWrite(t, filepath.Join(p.dir, "addr_traddr"), "127.0.0.1")
	cfgWrite(t, filepath.Join(p.dir, "addr_trsvcid"), strconv.Itoa(port))
	t.Cleanup(func() {
		ents, _ := os.ReadDir(filepath.Join(p.dir, "subsystems"))
		for _, e := range ents {
			os.Remove(filepath.Join(p.dir, "subsystems", e.Name()))
		}
		if err := os.Remove(p.dir); err != nil {
			t.Logf("nvmet: remove port: %v", err)
		}
	})
	return p
}

// expose makes subsystem s reachable through the port.
func (p *nvmetPort) expose(s *nvmetSubsys) {
	p.t.Helper()
	if err := os.Symlink(s.dir, filepath.Join(p.dir, "subsystems", s.nqn)); err != nil {
		p.t.Fatalf("nvmet: expose %s: %v", s.nqn, err)
	}
}

// hide removes subsystem s from the port; the target drops the
// controllers connected through it.
func (p *nvmetPort) hide(s *nvmetSubsys) {
	p.t.Helper()
	if err := os.Remove(filepath.Join(p.dir, "subsystems", s.nqn)); err != nil {
		p.t.Fatalf("nvmet: hide %s: %v", s.nqn, err)
	}
}
