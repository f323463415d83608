package agent

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/devices"
)

// Data anywhere in the written part of an image is refused, however far
// it lies from the places the probe samples: the images a new user saw
// formatted over.
func TestStageRefusesDataInImage(t *testing.T) {
	h := newHarness(t)
	for _, tc := range []struct {
		name      string
		size, off int64
		n         int
	}{
		{"7 bytes at 200 MiB", 512 * mib, 200 * mib, 7},
		{"512 bytes at 37 MiB", 512 * mib, 37 * mib, 512},
		{"64 bytes before the last MiB", 512 * mib, 511*mib - 64, 64},
		{"4 KiB at 700 MiB of 1 GiB", 1024 * mib, 700 * mib, 4 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := strings.NewReplacer(" ", "-").Replace(tc.name)
			v := h.newVol(name, tc.size, mountCap("ext4", snw))
			img := filepath.Join(h.root, name+".img")
			data := bytes.Repeat([]byte{0x5a}, tc.n)
			writeImage(t, img, tc.off, data)

			err := h.stage(v)
			wantCode(t, "stage over data", err, codes.FailedPrecondition)
			if want := fmt.Sprintf("offset %d", tc.off); !strings.Contains(status.Convert(err).Message(), want) {
				t.Errorf("refusal %q does not name %q", status.Convert(err).Message(), want)
			}
			// mkfs writes at the start: the image is as it was.
			if got := readImage(t, img, 0, mib); !bytes.Equal(got, make([]byte, mib)) {
				t.Error("stage wrote into the image's first MiB")
			}
			if got := readImage(t, img, tc.off, tc.n); !bytes.Equal(got, data) {
				t.Error("stage changed the image's data")
			}
			if d, err := (devices.Roots{}).FindLoop(img); err == nil {
				t.Fatalf("failed stage left %s attached", d.Path)
			}
		})
	}
}

// An image without data is formatted, and so is one written full of
// zeros: within the bound every byte is read, beyond it the device is
// probed as any other.
func TestStageFormatsBlankImage(t *testing.T) {
	h := newHarness(t)
	sparse := h.newVol("sparse", 512*mib, mountCap("ext4", snw))
	must(t, "stage a sparse image", h.stage(sparse))
	must(t, "unstage", h.unstage(sparse))

	zeros := h.newVol("zeros", 64*mib, mountCap("ext4", snw))
	writeImage(t, filepath.Join(h.root, "zeros.img"), 0, make([]byte, 64*mib))
	must(t, "stage an image written full of zeros", h.stage(zeros))
	must(t, "unstage", h.unstage(zeros))
}

func writeImage(t *testing.T, img string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(img, os.O_WRONLY, 0)
	must(t, "open image", err)
	defer f.Close()
	_, err = f.WriteAt(b, off)
	must(t, "write image", err)
	must(t, "sync image", f.Sync())
}

func readImage(t *testing.T, img string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(img)
	must(t, "open image", err)
	defer f.Close()
	b := make([]byte, n)
	_, err = f.ReadAt(b, off)
	must(t, "read image", err)
	return b
}
