package sysfs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
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
