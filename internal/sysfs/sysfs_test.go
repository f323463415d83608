package sysfs

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestGone(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&fs.PathError{Op: "open", Path: "/sys/x", Err: syscall.ENOENT}, true},
		{fmt.Errorf("read: %w", &fs.PathError{Op: "read", Path: "/sys/x", Err: syscall.ENODEV}), true},
		{os.ErrNotExist, true},
		{&fs.PathError{Op: "write", Path: "/sys/x", Err: syscall.EINVAL}, false},
		{errors.New("other"), false},
		{nil, false},
	} {
		if got := Gone(tc.err); got != tc.want {
			t.Errorf("Gone(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

func TestReadAttr(t *testing.T) {
	for in, want := range map[string]string{
		"live\n":           "live",
		"LIO-ORG \n":       "LIO-ORG",
		"uuid\x00\x00":     "uuid",
		"":                 "",
		"a b\n":            "a b",
		"traddr=1,src\n\n": "traddr=1,src",
	} {
		if got := Value([]byte(in)); got != want {
			t.Errorf("Value(%q) = %q, want %q", in, got, want)
		}
	}
	p := filepath.Join(t.TempDir(), "state")
	if err := os.WriteFile(p, []byte("FAILED\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if v, err := ReadAttr(p); err != nil || v != "FAILED" {
		t.Errorf("ReadAttr = %q, %v", v, err)
	}
	if _, err := ReadAttr(p + ".gone"); !Gone(err) {
		t.Errorf("ReadAttr of a missing attribute: %v, want Gone", err)
	}
}

func TestDir(t *testing.T) {
	root := t.TempDir()
	long := bytes.Repeat([]byte("0123456789abcdef"), 600) // 9600 bytes: more than one read of a page
	for name, content := range map[string][]byte{"state": []byte("running\n"), "long": append(long, '\n'), "vpd": {0, 0x83, 0, 4, 1, 2, 3, 4}} {
		if err := os.WriteFile(filepath.Join(root, name), content, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("../../devices/platform/host2/session1", filepath.Join(root, "device")); err != nil {
		t.Fatal(err)
	}
	d, err := OpenDir(root)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if v, err := d.Read("state"); err != nil || v != "running" {
		t.Errorf("Read(state) = %q, %v", v, err)
	}
	if v, err := d.Read("long"); err != nil || v != string(long) {
		t.Errorf("Read(long) = %d bytes, %v; want %d", len(v), err, len(long))
	}
	if v, err := ReadAttr(filepath.Join(root, "long")); err != nil || v != string(long) {
		t.Errorf("ReadAttr(long) = %d bytes, %v; want %d", len(v), err, len(long))
	}
	if b, err := d.ReadFile("vpd"); err != nil || !bytes.Equal(b, []byte{0, 0x83, 0, 4, 1, 2, 3, 4}) {
		t.Errorf("ReadFile(vpd) = %x, %v", b, err)
	}
	if b, err := ReadFile(filepath.Join(root, "long")); err != nil || len(b) != len(long)+1 {
		t.Errorf("ReadFile(long) = %d bytes, %v; want %d", len(b), err, len(long)+1)
	}
	if l, err := d.Readlink("device"); err != nil || l != "../../devices/platform/host2/session1" {
		t.Errorf("Readlink(device) = %q, %v", l, err)
	}
	if !d.Exists("device") || !d.Exists("state") || d.Exists("gone") {
		t.Error("Exists is wrong")
	}
	if _, err := d.Read("gone"); !Gone(err) || !strings.Contains(err.Error(), filepath.Join(root, "gone")) {
		t.Errorf("Read of a missing attribute: %v; want Gone, naming its path", err)
	}
	if _, err := d.ReadFile("gone"); !Gone(err) {
		t.Errorf("ReadFile of a missing attribute: %v; want Gone", err)
	}
	if _, err := OpenDir(filepath.Join(root, "gone")); !Gone(err) {
		t.Errorf("OpenDir of a missing directory: %v; want Gone", err)
	}
}
