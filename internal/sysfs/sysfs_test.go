package sysfs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
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
