package fs

import (
	"bytes"
	"testing"
)

func TestFilesystemUUIDParse(t *testing.T) {
	uuid := []byte{0x9a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7, 0xe8, 0xf9}
	const want = "9a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
	ext4 := make([]byte, 4096)
	copy(ext4[ext4MagicOffset:], ext4Magic)
	copy(ext4[ext4UUIDOffset:], uuid)
	xfs := make([]byte, 4096)
	copy(xfs[xfsMagicOffset:], xfsMagic)
	copy(xfs[xfsUUIDOffset:], uuid)
	for _, tc := range []struct {
		fsType string
		b      []byte
		ok     bool
	}{
		{Ext4, ext4, true}, {XFS, xfs, true},
		{XFS, ext4, false}, {Ext4, xfs, false}, {Ext4, make([]byte, 4096), false}, {Ext4, ext4[:1100], false},
		{"btrfs", ext4, false},
	} {
		got, err := filesystemUUID(bytes.NewReader(tc.b), tc.fsType)
		if tc.ok && (err != nil || got != want) {
			t.Errorf("%s: %q, %v; want %q", tc.fsType, got, err, want)
		}
		if !tc.ok && err == nil {
			t.Errorf("%s of %d bytes: %q, want an error", tc.fsType, len(tc.b), got)
		}
	}
}
