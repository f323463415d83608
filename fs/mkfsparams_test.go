package fs

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestParseMkfsParams(t *testing.T) {
	for _, tc := range []struct {
		fsType string
		vc     map[string]string
		want   []string
	}{
		{Ext4, nil, nil},
		{Ext4, map[string]string{"file": "x.img"}, nil},
		{Ext4, map[string]string{KeyBlockSize: "4096", KeyInodeSize: "512", KeyBytesPerInode: "8192", KeyExt4ReservedPercent: "0"},
			[]string{"-b", "4096", "-I", "512", "-i", "8192", "-m", "0"}},
		{Ext4, map[string]string{KeyNumberOfInodes: "100000", KeyExt4BigAlloc: "true", KeyExt4ClusterSize: "65536", KeyBlockSize: "4096"},
			[]string{"-b", "4096", "-N", "100000", "-O", "bigalloc", "-C", "65536"}},
		{Ext4, map[string]string{KeyExt4BigAlloc: "false", KeyInodeSize: "256"}, []string{"-I", "256"}},
		{XFS, map[string]string{KeyBlockSize: "2048", KeyInodeSize: "1024"}, []string{"-b", "size=2048", "-i", "size=1024"}},
	} {
		p, err := ParseMkfsParams(tc.fsType, tc.vc)
		if err != nil {
			t.Errorf("%s %v: %v", tc.fsType, tc.vc, err)
			continue
		}
		if got := p.args(tc.fsType); !slices.Equal(got, tc.want) {
			t.Errorf("%s %v: args %q, want %q", tc.fsType, tc.vc, got, tc.want)
		}
		if p.IsZero() != (len(tc.want) == 0) {
			t.Errorf("%s %v: IsZero %v", tc.fsType, tc.vc, p.IsZero())
		}
	}
	for _, tc := range []struct {
		fsType, key, value string
		want               string // in the message: the valid range
	}{
		{Ext4, KeyBlockSize, "8192", "1024, 2048 or 4096"},
		{Ext4, KeyBlockSize, "3000", "1024, 2048 or 4096"},
		{Ext4, KeyBlockSize, "4k", "1024, 2048 or 4096"},
		{Ext4, KeyInodeSize, "64", "power of two"},
		{Ext4, KeyInodeSize, "2048", "give blockSize"},
		{Ext4, KeyBytesPerInode, "512", "1024 to"},
		{Ext4, KeyNumberOfInodes, "-1", "16 to"},
		{Ext4, KeyExt4BigAlloc, "yes", `"true" or "false"`},
		{Ext4, KeyExt4ClusterSize, "65536", KeyExt4BigAlloc},
		{Ext4, KeyExt4ReservedPercent, "51", "0 to 50"},
		{Ext4, KeyExt4ReservedPercent, "", "0 to 50"},
		{XFS, KeyBlockSize, "512", "1024, 2048 or 4096"},
		{XFS, KeyInodeSize, "256", "512, 1024 or 2048"},
		{XFS, KeyBytesPerInode, "8192", "an ext4 parameter"},
		{XFS, KeyExt4ReservedPercent, "0", "an ext4 parameter"},
	} {
		_, err := ParseMkfsParams(tc.fsType, map[string]string{tc.key: tc.value})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.key) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s=%q: %v, want INVALID_ARGUMENT naming the key and %q", tc.fsType, tc.key, tc.value, err, tc.want)
		}
	}
	// Both ways of sizing the inode table at once.
	if _, err := ParseMkfsParams(Ext4, map[string]string{KeyBytesPerInode: "8192", KeyNumberOfInodes: "1000"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bytesPerInode and numberOfInodes: %v", err)
	}
	// mkfsArgs puts them before the device.
	p, _ := ParseMkfsParams(Ext4, map[string]string{KeyBlockSize: "1024"})
	args, err := mkfsArgs(Ext4, "/dev/x", MkfsOptions{Params: p})
	if err != nil || !slices.Equal(args[len(args)-4:], []string{"-b", "1024", "--", "/dev/x"}) {
		t.Errorf("mkfsArgs: %q, %v", args, err)
	}
}
