package agent

import (
	"errors"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestValidatePath(t *testing.T) {
	for _, tc := range []struct {
		p  string
		ok bool
	}{
		{"/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv/mount", true},
		{"/a b/$(reboot);`id`", true}, // no shell anywhere: harmless
		{"", false},
		{"relative/path", false},
		{"/a/../etc", false},
		{"/a//b", false},
		{"/a/b/", false},
		{"/a/./b", false},
		{"/", false},
		{"/a\x00b", false},
		{"/a\nb", false},
		{"/a\x1b[31mb", false},
		{"/a\xffb", false},
		{"/" + strings.Repeat("a", 5000), false},
		{"/a/" + strings.Repeat("n", 255), true},
		{"/a/" + strings.Repeat("n", 256) + "/b", false},
	} {
		err := validatePath("target_path", tc.p)
		if (err == nil) != tc.ok {
			t.Errorf("validatePath(%q) = %v, want ok=%t", tc.p, err, tc.ok)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("validatePath(%q) = %v, not ErrInvalidArgument", tc.p, err)
		}
		if err != nil && !strings.Contains(err.Error(), "target_path") {
			t.Errorf("validatePath(%q) = %v does not name the field", tc.p, err)
		}
	}
}

func TestValidateVolumeID(t *testing.T) {
	for id, ok := range map[string]bool{
		"pvc-1234":               true,
		"../../etc":              true, // opaque, never a path
		"":                       false,
		strings.Repeat("x", 129): false,
		"a\nb":                   false,
		"\xff":                   false,
	} {
		if err := validateVolumeID(id); (err == nil) != ok {
			t.Errorf("validateVolumeID(%q) = %v, want ok=%t", id, err, ok)
		}
	}
}

func TestValidateCapability(t *testing.T) {
	fsTypes := []string{"ext4", "xfs"}
	parse := newFakeFS().ParseMountOptions
	mnt := func(fs string, mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
		return mountCap(fs, mode, flags...)
	}
	for _, tc := range []struct {
		name string
		c    *csi.VolumeCapability
		ok   bool
		ro   bool
	}{
		{"default fs", mnt("", snw), true, false},
		{"xfs", mnt("xfs", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), true, false},
		{"single node multi writer", mnt("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER), true, false},
		{"reader only", mnt("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY), true, true},
		{"multi node reader only", mnt("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY), true, true},
		{"multi writer mount", mnt("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), false, false},
		{"multi node single writer mount", mnt("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER), false, false},
		{"multi writer block", blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), true, false},
		{"unknown mode", mnt("ext4", csi.VolumeCapability_AccessMode_UNKNOWN), false, false},
		{"btrfs", mnt("btrfs", snw), false, false},
		{"refused option", mnt("ext4", snw, "errors=panic"), false, false},
		{"control char option", mnt("ext4", snw, "noatime\n"), false, false},
		{"nil", nil, false, false},
		{"no access type", &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: snw}}, false, false},
		{"mount group", &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{VolumeMountGroup: "1000"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: snw},
		}, false, false},
	} {
		vc, err := validateCapability(tc.c, fsTypes, parse)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok=%t", tc.name, err, tc.ok)
			continue
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v is not ErrInvalidArgument", tc.name, err)
		}
		if err == nil && vc.readOnly() != tc.ro {
			t.Errorf("%s: readOnly %t, want %t", tc.name, vc.readOnly(), tc.ro)
		}
		if err == nil && !vc.Block && vc.FsType == "" {
			t.Errorf("%s: fs type not defaulted", tc.name)
		}
	}
}

func TestMergeContext(t *testing.T) {
	m, err := mergeContext(map[string]string{"file": "a"}, map[string]string{"extra": "b", "file": "a"})
	if err != nil || m["file"] != "a" || m["extra"] != "b" {
		t.Fatalf("merge: %v %v", m, err)
	}
	if _, err := mergeContext(map[string]string{"file": "a"}, map[string]string{"file": "b"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("conflicting keys: %v", err)
	}
	if _, err := mergeContext(map[string]string{"file": "a\x00"}, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("NUL in a value: %v", err)
	}
}
