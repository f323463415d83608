package fs

import "testing"

// BenchmarkIsMountPoint measures the publish hot path's mount check with
// each kernel interface (/proc is a mount point on every Linux host).
func BenchmarkIsMountPoint(b *testing.B) {
	for name, m := range mountCheckers() {
		b.Run(name, func(b *testing.B) {
			if _, err := m("/proc"); err != nil {
				b.Skipf("%s unavailable: %v", name, err)
			}
			for b.Loop() {
				if ok, err := m("/proc"); err != nil || !ok {
					b.Fatalf("%v %v", ok, err)
				}
			}
		})
	}
}

func BenchmarkParseMountOptions(b *testing.B) {
	opts := []string{"ro", "nodev", "nosuid", "noatime", "discard", "errors=remount-ro", `context="system_u:object_r:container_file_t:s0:c1,c2"`}
	for b.Loop() {
		if _, _, err := ParseMountOptions(opts); err != nil {
			b.Fatal(err)
		}
	}
}
