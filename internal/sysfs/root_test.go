package sysfs

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestRoot(t *testing.T) {
	if p := (Root{}).Path("class", "block", "sda"); p != "/sys/class/block/sda" {
		t.Errorf("zero Root: Path = %q, want /sys/class/block/sda", p)
	}
	if At("") != (Root{}) || (Root{}).Path() != "/sys" {
		t.Error("At(\"\") is not /sys")
	}
	dir := t.TempDir()
	r := At(dir)
	if p := r.Path("class", "nvme"); p != filepath.Join(dir, "class", "nvme") {
		t.Errorf("Path = %q", p)
	}
	if err := os.MkdirAll(r.Path("block", "nvme0n1"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"size", "nsid"} {
		if err := os.WriteFile(r.Path("block", "nvme0n1", name), []byte("8\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("../../class/nvme/nvme0", r.Path("block", "nvme0n1", "device")); err != nil {
		t.Fatal(err)
	}
	if v, err := r.ReadAttr("block", "nvme0n1", "size"); err != nil || v != "8" {
		t.Errorf("ReadAttr = %q, %v", v, err)
	}
	if names, err := r.List("block", "nvme0n1"); err != nil || !slices.Equal(names, []string{"device", "nsid", "size"}) {
		t.Errorf("List = %q, %v", names, err)
	}
	if _, err := r.List("class", "nvme"); !Gone(err) {
		t.Errorf("List of a missing directory: %v, want Gone", err)
	}
	if l, err := r.Readlink("block", "nvme0n1", "device"); err != nil || l != "../../class/nvme/nvme0" {
		t.Errorf("Readlink = %q, %v", l, err)
	}
	d, err := r.OpenDir("block", "nvme0n1")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if v, err := d.Read("nsid"); err != nil || v != "8" {
		t.Errorf("OpenDir: Read = %q, %v", v, err)
	}
}
