package file

import (
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/test/conformance"
)

// TestConformance runs the transport conformance suite on loop devices
// over image files in a temporary root; it needs root.
func TestConformance(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices)")
	}
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ft, err := New(t.TempDir(), l)
	if err != nil {
		t.Fatal(err)
	}
	var seq atomic.Int32
	conformance.Run(t, conformance.Harness{
		Transport: agent.TransportFunc(agent.TransportKind{Name: Name, Keys: TransportKeys()}, ft.Parse),
		NewVolume: func(t *testing.T, size int64) *conformance.Volume {
			name := fmt.Sprintf("vol-%d.img", seq.Add(1))
			img := filepath.Join(ft.root, name)
			if err := os.WriteFile(img, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, size); err != nil {
				t.Fatal(err)
			}
			alias := filepath.Join(ft.root, "link-"+name)
			if err := os.Link(img, alias); err != nil {
				t.Fatal(err)
			}
			return &conformance.Volume{
				Context: map[string]string{KeyFile: name},
				Alias:   map[string]string{KeyFile: "link-" + name},
				Grow: func(t *testing.T, size int64) {
					if err := os.Truncate(img, size); err != nil {
						t.Fatal(err)
					}
				},
				Vanish: func(t *testing.T) {
					for _, p := range []string{img, alias} {
						if err := os.Remove(p); err != nil {
							t.Fatal(err)
						}
					}
				},
			}
		},
	})
}
