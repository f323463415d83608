package fs

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The samples in testdata are `blkid -p -o export` output from util-linux
// 2.38 (DEVNAME lines removed), except blkid-partition-entry.txt, which is
// written after the format blkid prints for a partition.
func TestSignatureFromBlkidSamples(t *testing.T) {
	for _, tc := range []struct {
		file  string
		want  Signature
		found bool
	}{
		{"blkid-ext4-label.txt", Signature{Type: "ext4", Usage: "filesystem", UUID: "d605d796-aff1-45cf-a76f-a5b826ad2405", Label: "data vol$1"}, true},
		{"blkid-xfs.txt", Signature{Type: "xfs", Usage: "filesystem", UUID: "8dc90613-d433-4122-9944-bc0bfebf0437", Label: "xfsvol"}, true},
		{"blkid-swap.txt", Signature{Type: "swap", Usage: "other", UUID: "677d7022-96a5-43d0-9ebe-91879cfb31a6"}, true},
		{"blkid-gpt.txt", Signature{Type: "gpt", Usage: "partition_table", UUID: "61b5bb5d-ba29-614d-9a14-84d0ae779779", PartitionTable: "gpt"}, true},
		{"blkid-dos.txt", Signature{Type: "dos", Usage: "partition_table", UUID: "3554c0b0", PartitionTable: "dos"}, true},
		{"blkid-luks1.txt", Signature{Type: "crypto_LUKS", Usage: "crypto", UUID: "6b3c1f0e-8d3e-4f7a-9c2b-0a1b2c3d4e5f"}, true},
		{"blkid-md090.txt", Signature{Type: "linux_raid_member", Usage: "raid", UUID: "11111111-2222-2222-3333-333344444444"}, true},
		{"blkid-partition-entry.txt", Signature{}, false},
	} {
		t.Run(tc.file, func(t *testing.T) {
			out, err := os.ReadFile(filepath.Join("testdata", tc.file))
			if err != nil {
				t.Fatal(err)
			}
			sig, found, err := signatureFromBlkid(0, out)
			if err != nil {
				t.Fatal(err)
			}
			if sig != tc.want || found != tc.found {
				t.Errorf("got %+v found=%v, want %+v found=%v", sig, found, tc.want, tc.found)
			}
			if found && !strings.Contains(sig.String(), sig.Type) {
				t.Errorf("String() %q does not name the type %q", sig.String(), sig.Type)
			}
		})
	}
}

func TestSignatureFromBlkidExitCodes(t *testing.T) {
	sig, found, err := signatureFromBlkid(blkidExitNotFound, nil)
	if err != nil || found || !sig.Blank() {
		t.Errorf("exit 2: got %+v %v %v, want blank", sig, found, err)
	}
	sig, found, err = signatureFromBlkid(blkidExitAmbivalent, nil)
	if err != nil || !found || sig.Type != typeAmbivalent {
		t.Errorf("exit 8: got %+v %v %v, want ambivalent", sig, found, err)
	}
	if _, _, err := signatureFromBlkid(blkidExitUsage, nil); err == nil {
		t.Error("exit 4: no error")
	}
	if _, _, err := signatureFromBlkid(0, []byte("TYPE=ext4\nnot a tag\n")); err == nil {
		t.Error("malformed output: no error")
	}
}

func TestParseBlkidExportStopsAtFirstDevice(t *testing.T) {
	in := "DEVNAME=/dev/a\nTYPE=ext4\n\nDEVNAME=/dev/b\nTYPE=xfs\n"
	tags, err := parseBlkidExport(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if tags["TYPE"] != "ext4" || tags["DEVNAME"] != "/dev/a" {
		t.Errorf("got %v", tags)
	}
}

func TestSignatureFilesystemOverPartitionTable(t *testing.T) {
	sig := signatureFromTags(map[string]string{"TYPE": "ext4", "USAGE": "filesystem", "PTTYPE": "dos", "PTUUID": "x"})
	if sig.Type != "ext4" || sig.PartitionTable != "dos" || sig.UUID != "" {
		t.Errorf("got %+v", sig)
	}
	if !strings.Contains(sig.String(), `"dos" partition table`) {
		t.Errorf("String() = %q, want the partition table named", sig.String())
	}
}

func TestFirstNonZero(t *testing.T) {
	for _, tc := range []struct {
		n, at, want int
	}{
		{0, -1, -1}, {7, -1, -1}, {1 << 20, -1, -1},
		{1 << 20, 0, 0}, {1 << 20, 5, 5}, {1 << 20, 8, 8}, {1 << 20, 1<<20 - 1, 1<<20 - 1}, {13, 12, 12},
	} {
		b := make([]byte, tc.n)
		if tc.at >= 0 {
			b[tc.at] = 0x40
		}
		if got := firstNonZero(b); got != tc.want {
			t.Errorf("len %d, byte at %d: got %d, want %d", tc.n, tc.at, got, tc.want)
		}
	}
	if firstNonZero(bytes.Repeat([]byte{0}, 100)) != -1 {
		t.Error("zeros reported non-zero")
	}
}

// Every byte of every far window is read on every device size where it
// exists, with aligned ranges inside the device; windows inside the first
// or the last MiB are left to those reads.
func TestFarSpans(t *testing.T) {
	for _, size := range []int64{4096, 1 << 20, 1<<20 + 512, 3 << 20, 4<<20 + 4096, 5<<20 + 3*512, 64 << 20, 1 << 40} {
		tail := max(0, (size-headSize)&^(blockAlign-1))
		spans := farSpans(size, headSize, tail)
		covered := func(off int64) bool {
			if off < headSize || off >= tail {
				return true
			}
			for _, s := range spans {
				if off >= s[0] && off < s[1] {
					return true
				}
			}
			return false
		}
		for _, s := range spans {
			if s[0]%blockAlign != 0 || s[0] >= s[1] || s[1] > size || (s[1]%blockAlign != 0 && s[1] != size) {
				t.Errorf("size %d: bad span %v", size, s)
			}
		}
		for _, w := range farWindows {
			off := w.off
			if off < 0 {
				off += size
			}
			for b := off; b < off+w.length; b++ {
				if b >= 0 && b < size && !covered(b) {
					t.Errorf("size %d: byte %d of window %q is not read", size, b, w.who)
					break
				}
			}
		}
	}
}

func TestLibblkidVersion(t *testing.T) {
	for out, want := range map[string][2]int{
		"blkid from util-linux 2.38.1  (libblkid 2.38.1, 04-Aug-2022)\n":  {2, 38},
		"blkid from util-linux 2.41.5  (libblkid 2.41.5, 20-Mar-2025)":    {2, 41},
		"blkid from util-linux 2.42-rc1  (libblkid 2.42-rc1, 1-Jan-2026)": {2, 42},
		"blkid from util-linux 2.40  (libblkid 2.40.0, 27-Mar-2024)":      {2, 40},
	} {
		got, ok := libblkidVersion(out)
		if !ok || got != want {
			t.Errorf("%q: %v %v, want %v", out, got, ok, want)
		}
	}
	for _, out := range []string{"", "BusyBox v1.36.1 multi-call binary.", "blkid (libblkid x.y)"} {
		if v, ok := libblkidVersion(out); ok {
			t.Errorf("%q: %v, want not understood", out, v)
		}
	}
}
