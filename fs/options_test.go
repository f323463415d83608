package fs

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestParseMountOptions(t *testing.T) {
	for _, tc := range []struct {
		name  string
		opts  []string
		flags uintptr
		data  string
	}{
		{"none", nil, 0, ""},
		{"defaults", []string{"defaults"}, 0, ""},
		{"ro", []string{"ro"}, MS_RDONLY, ""},
		{"ro then rw", []string{"ro", "rw"}, 0, ""},
		{"rw then ro", []string{"rw", "ro"}, MS_RDONLY, ""},
		{"hardening", []string{"nodev", "nosuid", "noexec"}, MS_NODEV | MS_NOSUID | MS_NOEXEC, ""},
		{"atime last wins", []string{"noatime", "relatime"}, MS_RELATIME, ""},
		{"strictatime", []string{"relatime", "strictatime"}, MS_STRICTATIME, ""},
		{"nodiratime", []string{"nodiratime", "noatime"}, MS_NODIRATIME | MS_NOATIME, ""},
		{"sync async", []string{"sync", "dirsync", "async"}, MS_DIRSYNC, ""},
		{"lazytime", []string{"lazytime"}, MS_LAZYTIME, ""},
		{"data options", []string{"discard", "errors=remount-ro", "data=ordered", "commit=30"}, 0, "discard,errors=remount-ro,data=ordered,commit=30"},
		{"xfs options", []string{"inode64", "nouuid", "logbufs=8", "logbsize=256k", "allocsize=1m", "prjquota"}, 0, "inode64,nouuid,logbufs=8,logbsize=256k,allocsize=1m,prjquota"},
		{"mixed", []string{"ro", "nodiscard", "noatime", "data=journal"}, MS_RDONLY | MS_NOATIME, "nodiscard,data=journal"},
		{"selinux", []string{"context=system_u:object_r:container_file_t:s0"}, 0, "context=system_u:object_r:container_file_t:s0"},
		{"selinux categories quoted", []string{`context="system_u:object_r:container_file_t:s0:c12,c34"`}, 0, `context="system_u:object_r:container_file_t:s0:c12,c34"`},
		{"selinux range", []string{`rootcontext="system_u:object_r:svirt_t:s0-s0:c0.c1023"`}, 0, `rootcontext=system_u:object_r:svirt_t:s0-s0:c0.c1023`},
		{"barrier on", []string{"barrier=1", "barrier"}, 0, "barrier=1,barrier"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			flags, data, err := ParseMountOptions(tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			if flags != tc.flags || data != tc.data {
				t.Errorf("got flags %#x data %q, want %#x %q", flags, data, tc.flags, tc.data)
			}
		})
	}
}

func TestParseMountOptionsRefused(t *testing.T) {
	for _, tc := range []struct {
		opt string
		why string // part of the message
	}{
		{"", "empty"},
		{"ro,nosuid", "comma"},
		{"noatime,nobarrier", "comma"},
		{"discard,rw", "comma"},
		{"ro\n", "control character"},
		{"ro\x00", "control character"},
		{" ro", "whitespace"},
		{"nobarrier", "barriers"},
		{"barrier=0", "barriers"},
		{"norecovery", "recovery"},
		{"noload", "recovery"},
		{"data=writeback", "stale data"},
		{"errors=panic", "panics"},
		{"bind", "publish"},
		{"remount", "remount"},
		{"dax", "semantics"},
		{"user", "not an allowed"},
		{"nofail", "not an allowed"},
		{"x-mount.mkdir", "not an allowed"},
		{"commit=abc", "integer"},
		{"commit=-1", "integer"},
		{"commit=99999999", "integer"},
		{"commit", "needs a value"},
		{"errors=foo", "not one of"},
		{"logbufs=9", "integer"},
		{"allocsize=1t", "size"},
		{"discard=1", "not an allowed"},
		{"ro=1", "not an allowed"},
		{"context=system_u:object_r:t:s0:c1,c2", "double quotes"},
		{`context="system_u:object_r:t:s0"x`, "quote"},
		{`context="system_u:object_r:t:s0`, "quote"},
		{`context=""`, "SELinux"},
		{"context=nocolon", "SELinux"},
		{`context="a:b:c:s0",rw`, "quote"},
		{"context=a:b:c:s0:c1;rm", "SELinux"},
		{"data=ordered=x", "comma, a quote or '='"},
		{strings.Repeat("a", 600), "longer than"},
	} {
		t.Run(tc.opt, func(t *testing.T) {
			_, _, err := ParseMountOptions([]string{"ro", tc.opt})
			if err == nil {
				t.Fatalf("%q accepted", tc.opt)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("error %v does not wrap ErrInvalidArgument", err)
			}
			if !strings.Contains(err.Error(), tc.why) {
				t.Errorf("error %q does not say %q", err, tc.why)
			}
			if len(tc.opt) < 100 && !strings.Contains(err.Error(), fmt.Sprintf("%q", tc.opt)) {
				t.Errorf("error %q does not name the option", err)
			}
		})
	}
}

// splitData splits a data string at commas outside double quotes.
func splitData(data string) []string {
	var parts []string
	start, quoted := 0, false
	for i := 0; i < len(data); i++ {
		switch data[i] {
		case '"':
			quoted = !quoted
		case ',':
			if !quoted {
				parts = append(parts, data[start:i])
				start = i + 1
			}
		}
	}
	return append(parts, data[start:])
}

func FuzzParseMountOptions(f *testing.F) {
	for _, s := range []string{"ro", "noatime", "errors=remount-ro", "commit=5", `context="a:b:c:s0:c1,c2"`,
		"ro,rw", "nobarrier", "data=writeback", "a\x00b", "context=a:b:c", "logbsize=64k", "\n"} {
		f.Add(s, "nodev")
	}
	const known = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_SYNCHRONOUS | MS_DIRSYNC |
		MS_NOATIME | MS_NODIRATIME | MS_RELATIME | MS_STRICTATIME | MS_LAZYTIME
	f.Fuzz(func(t *testing.T, a, b string) {
		flags, data, err := ParseMountOptions([]string{a, b})
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("error %v does not wrap ErrInvalidArgument", err)
			}
			return
		}
		if flags&^known != 0 {
			t.Fatalf("unexpected flags %#x", flags)
		}
		if strings.ContainsAny(data, "\x00\n\r\t \\'") {
			t.Fatalf("data %q has a forbidden character", data)
		}
		// Each accepted option is one element of the data string, so an
		// option can never smuggle in another.
		dataOpts := 0
		for _, o := range []string{a, b} {
			if _, ok := flagOptions[o]; !ok {
				dataOpts++
			}
		}
		if data == "" {
			if dataOpts != 0 {
				t.Fatalf("%q %q: %d data options but empty data", a, b, dataOpts)
			}
			return
		}
		parts := splitData(data)
		if len(parts) != dataOpts {
			t.Fatalf("%q %q: data %q has %d parts, want %d", a, b, data, len(parts), dataOpts)
		}
		for _, p := range parts {
			key, _, _ := strings.Cut(p, "=")
			if _, ok := valueOptions[key]; !ok && !dataOptions[p] {
				t.Fatalf("data part %q not from the allowlist", p)
			}
			if _, bad := refused[p]; bad {
				t.Fatalf("refused option %q accepted", p)
			}
		}
		// Parsing is stable: the accepted data parses again to itself.
		_, again, err := ParseMountOptions(parts)
		if err != nil || again != data {
			t.Fatalf("re-parse of %q: %q, %v", data, again, err)
		}
	})
}
