package target

import (
	"testing"

	"golang.org/x/sys/unix"
)

// Allocated is the bytes a (sparse) file has on its filesystem: what a
// target's backing file holds after writes and trims.
func Allocated(t testing.TB, name string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(name, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}
