package devices

import (
	"os"
	"path/filepath"
	"testing"
)

func TestParseVPD83(t *testing.T) {
	for _, tc := range []struct {
		file      string
		preferred string
		texts     []string
	}{
		{"lio-naa6.bin", testWWID, []string{testWWID, "t10.LIO-ORG a1b2c3d4-e5f6-0718-293a-4b5c6d7e8f90", "", "", "", ""}},
		{"eui64-t10.bin", "eui.0025385b71b0f0a1", []string{"t10.ACME    DISK0001", "eui.0025385b71b0f0a1"}},
	} {
		page, err := os.ReadFile(filepath.Join("testdata", "vpd", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		ds, err := ParseVPD83(page)
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		if len(ds) != len(tc.texts) {
			t.Fatalf("%s: %d designators, want %d", tc.file, len(ds), len(tc.texts))
		}
		for i, d := range ds {
			if got := d.Text(); got != tc.texts[i] {
				t.Errorf("%s: designator %d (type %d assoc %d) = %q, want %q", tc.file, i, d.Type, d.Association, got, tc.texts[i])
			}
		}
		if got := PreferredWWID(ds); got != tc.preferred {
			t.Errorf("%s: preferred %q, want %q", tc.file, got, tc.preferred)
		}
	}
	// The SCSI name string of the LIO page names the target port, not the LUN.
	page, _ := os.ReadFile(filepath.Join("testdata", "vpd", "lio-naa6.bin"))
	ds, _ := ParseVPD83(page)
	if last := ds[len(ds)-1]; last.Type != desigSCSIName || last.Association != 1 || string(last.Value[:4]) != "iqn." {
		t.Errorf("last designator %+v, want the target port's SCSI name string", last)
	}
}

func TestParseVPD83Errors(t *testing.T) {
	trunc, err := os.ReadFile(filepath.Join("testdata", "vpd", "truncated.bin"))
	if err != nil {
		t.Fatal(err)
	}
	for name, page := range map[string][]byte{
		"empty":           nil,
		"short header":    {0, 0x83, 0},
		"other page":      {0, 0x80, 0, 0},
		"length too long": trunc,
		"desc too long":   {0, 0x83, 0, 6, 1, 3, 0, 8, 0x60, 0x01},
		"desc header cut": {0, 0x83, 0, 2, 1, 3},
	} {
		if ds, err := ParseVPD83(page); err == nil {
			t.Errorf("%s: parsed %+v, want an error", name, ds)
		}
	}
	if ds, err := ParseVPD83([]byte{0, 0x83, 0, 0}); err != nil || len(ds) != 0 || PreferredWWID(ds) != "" {
		t.Errorf("empty page: %v %v", ds, err)
	}
}

func FuzzParseVPD83(f *testing.F) {
	for _, name := range []string{"lio-naa6.bin", "eui64-t10.bin", "truncated.bin"} {
		b, err := os.ReadFile(filepath.Join("testdata", "vpd", name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, page []byte) {
		ds, err := ParseVPD83(page)
		if err != nil {
			return
		}
		for _, d := range ds {
			_ = d.Text()
		}
		_ = PreferredWWID(ds)
	})
}
