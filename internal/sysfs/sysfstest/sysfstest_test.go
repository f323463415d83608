package sysfstest

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestTree(t *testing.T) {
	tr := New(t)
	tr.Files(map[string]string{
		"class/nvme/nvme0/state":     "live\n",
		"class/nvme/nvme0/transport": "tcp\n",
	})
	tr.File("module/nvme_tcp/parameters/scan", "")
	tr.Link("block/nvme0n1/device", "../../class/nvme/nvme0")
	tr.Dir("block/nvme0n1/holders")
	r := tr.Root()
	if v, err := r.ReadAttr("block", "nvme0n1", "device", "state"); err != nil || v != "live" {
		t.Errorf("state through the link = %q, %v", v, err)
	}
	if b, err := os.ReadFile(r.Path("module/nvme_tcp/parameters/scan")); err != nil || len(b) != 0 {
		t.Errorf("empty file = %q, %v", b, err)
	}
	if names, err := r.List("block", "nvme0n1"); err != nil || !slices.Equal(names, []string{"device", "holders"}) {
		t.Errorf("List = %q, %v", names, err)
	}
	tr.File("class/nvme/nvme0/state", "deleting\n")
	if v, _ := r.ReadAttr("class", "nvme", "nvme0", "state"); v != "deleting" {
		t.Errorf("rewritten state = %q", v)
	}
	tr.Remove("class/nvme/nvme0")
	if _, err := r.ReadAttr("block", "nvme0n1", "device", "state"); !os.IsNotExist(err) {
		t.Errorf("state after Remove: %v", err)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "vpd.bin"), []byte{0, 0x83, 0, 0}, 0o644); err != nil {
		t.Fatal(err)
	}
	spec := "# a saved tree\n\n" +
		"f devices/virtual/block/loop0/uevent MAJOR=7\\nMINOR=0\n" +
		"f devices/virtual/block/loop0/vendor LIO-ORG \n" +
		"f devices/virtual/block/loop0/scan\n" +
		"l class/block/loop0 ../../devices/virtual/block/loop0\n" +
		"b devices/virtual/block/loop0/vpd_pg83 vpd.bin\n" +
		"d devices/virtual/block/loop0/holders\n"
	name := filepath.Join(dir, "sysfs.txt")
	if err := os.WriteFile(name, []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	tr := New(t)
	tr.Load(name)
	r := tr.Root()
	for path, want := range map[string]string{
		"class/block/loop0/uevent":   "MAJOR=7\nMINOR=0\n",
		"class/block/loop0/vendor":   "LIO-ORG \n",
		"class/block/loop0/scan":     "\n",
		"class/block/loop0/vpd_pg83": "\x00\x83\x00\x00",
	} {
		if b, err := os.ReadFile(r.Path(path)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", path, b, err, want)
		}
	}
	if names, err := r.List("class", "block", "loop0", "holders"); err != nil || len(names) != 0 {
		t.Errorf("holders = %q, %v; want an empty directory", names, err)
	}
}
