package devices

import (
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

const (
	testNQN  = "nqn.2014-08.org.berth:vol-1"
	testWWID = "naa.6001405a1b2c3d4e5f60718293a4b5c6"
)

func TestLookupFakeSysfs(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	for _, tc := range []struct {
		name    string
		path    string
		maj     uint32
		min     uint32
		size    int64
		diskSeq uint64
		id      Identity
	}{
		{"loop0", "loop0", 7, 0, 204800 * 512, 15, Identity{Kind: KindLoop, BackingFile: "/var/lib/berth/volumes/pvc-1/disk.img"}},
		{"loop1", "loop1", 7, 1, 0, 3, Identity{Kind: KindLoop}},
		{"sdb", "sdb", 8, 16, 1 << 30, 21, Identity{Kind: KindSCSI, HCTL: "2:0:0:1", WWID: testWWID}},
		// No wwid attribute: taken from vpd_pg83.
		{"sdc", "sdc", 8, 32, 1 << 30, 22, Identity{Kind: KindSCSI, HCTL: "3:0:0:1", WWID: testWWID}},
		{"dm-0", "dm-0", 253, 0, 1 << 30, 23, Identity{Kind: KindDM, WWID: "mpath-36001405a1b2c3d4e5f60718293a4b5c6", DMName: "mpatha"}},
		{"nvme0n1", "nvme0n1", 259, 0, 1 << 29, 30, Identity{Kind: KindNVMe, NQN: testNQN, NSID: 1,
			UUID: "5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", NGUID: "5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8",
			WWID: "uuid.5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"}},
		// All-zero UUID and NGUID mean "none".
		{"nvme1n2", "nvme1n2", 259, 2, 2048 * 512, 31, Identity{Kind: KindNVMe, NQN: "nqn.2014-08.org.berth:vol-2", NSID: 2, WWID: "nvme.0000-3130-4d5a-00000002"}},
		// The hidden per-path node of a native multipath namespace has no identity.
		{"nvme0c0n1", "nvme0c0n1", 259, 1, 1 << 29, 0, Identity{}},
		{"vda", "vda", 252, 0, 4194304 * 512, 0, Identity{}},
		{"vda1", "vda1", 252, 1, 2048 * 512, 0, Identity{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := roots.Lookup(tc.name)
			if err != nil {
				t.Fatal(err)
			}
			if d.Name != tc.name || d.Path != filepath.Join(roots.Dev, tc.path) || d.Major != tc.maj || d.Minor != tc.min {
				t.Errorf("got %s %s %d:%d, want %s %s %d:%d", d.Name, d.Path, d.Major, d.Minor, tc.name, tc.path, tc.maj, tc.min)
			}
			if d.Size != tc.size || d.DiskSeq != tc.diskSeq {
				t.Errorf("size %d diskseq %d, want %d %d", d.Size, d.DiskSeq, tc.size, tc.diskSeq)
			}
			if d.ID != tc.id {
				t.Errorf("identity\n got %+v\nwant %+v", d.ID, tc.id)
			}
		})
	}
	d, err := roots.Lookup("sdc")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{testWWID, "t10.LIO-ORG a1b2c3d4-e5f6-0718-293a-4b5c6d7e8f90"}; !slices.Equal(d.designators, want) {
		t.Errorf("designators %q, want %q", d.designators, want)
	}

	if _, err := roots.Lookup("sdz"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("roots.Lookup(sdz) = %v, want ErrNotFound", err)
	}
	for _, bad := range []string{"", "..", "../sda", "a/b"} {
		if _, err := roots.Lookup(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("roots.Lookup(%q) = %v, want ErrInvalidArgument", bad, err)
		}
	}
	// A map whose table is not loaded yet is marked suspended.
	if d, err := roots.Lookup("dm-1"); err != nil || !d.dmSuspended {
		t.Errorf("dm-1: %+v %v, want suspended", d, err)
	}
}

func TestHoldersSlaves(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	if h, err := roots.Holders("sdb"); err != nil || !slices.Equal(h, []string{"dm-0"}) {
		t.Errorf("roots.Holders(sdb) = %q, %v", h, err)
	}
	if h, err := roots.Holders("loop0"); err != nil || len(h) != 0 {
		t.Errorf("roots.Holders(loop0) = %q, %v", h, err)
	}
	if s, err := roots.Slaves("dm-0"); err != nil || !slices.Equal(s, []string{"sdb", "sdc"}) {
		t.Errorf("roots.Slaves(dm-0) = %q, %v", s, err)
	}
	if _, err := roots.Holders("sdz"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("roots.Holders(sdz) = %v, want ErrNotFound", err)
	}
	if _, err := roots.Slaves("../x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("roots.Slaves(../x) = %v, want ErrInvalidArgument", err)
	}
}

func TestMatchers(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	all := map[string]*Device{}
	if err := roots.scanBlock("", nil, func(d *Device) bool { all[d.Name] = d; return false }); err != nil {
		t.Fatal(err)
	}
	if len(all) != 11 {
		t.Fatalf("scan found %d devices, want 11", len(all))
	}
	for _, tc := range []struct {
		m    Matcher
		want []string
	}{
		{MatchSCSI("2:0:0:1", "36001405a1b2c3d4e5f60718293a4b5c6"), []string{"sdb"}},
		{MatchSCSI("", testWWID), []string{"sdb", "sdc"}},
		{MatchSCSI("", "0x6001405A1B2C3D4E5F60718293A4B5C6"), []string{"sdb", "sdc"}},
		{MatchSCSI("3:0:0:", "mpath-36001405a1b2c3d4e5f60718293a4b5c6"), []string{"sdc"}},
		// The T10 vendor designator matches too, in udev's form.
		{MatchSCSI("", "1LIO-ORG_a1b2c3d4-e5f6-0718-293a-4b5c6d7e8f90"), []string{"sdb", "sdc"}},
		{MatchSCSI("2:0:0:1", "naa.6001405a1b2c3d4e5f60718293a4b5c7"), nil},
		{MatchSCSI("2:0:0:1", ""), []string{"sdb"}},
		{MatchSCSI("2:0:0", ""), []string{"sdb"}},
		{MatchSCSI("2:0:0:10", ""), nil},
		{MatchSCSI("2:0:0:", ""), []string{"sdb"}},
		{MatchSCSI("", ""), nil},
		{MatchSCSIAddress(2, 0, 0, 1), []string{"sdb"}},
		{MatchSCSIAddress(3, 0, -1, 1), []string{"sdc"}},
		{MatchSCSIAddress(2, 0, 1, 1), nil},
		{MatchSCSIAddress(2, 0, 0, 10), nil},
		{MatchSCSIAddress(2, 1, 0, 1), nil},
		{MatchNVMe(testNQN, 1, "", ""), []string{"nvme0n1"}},
		{MatchNVMe(testNQN, 1, "5F1C2A3B-4D5E-6F70-8192-A3B4C5D6E7F8", ""), []string{"nvme0n1"}},
		{MatchNVMe(testNQN, 0, "", "5f1c2a3b4d5e6f708192a3b4c5d6e7f8"), []string{"nvme0n1"}},
		{MatchNVMe(testNQN, 1, "", "5f1c2a3b4d5e6f708192a3b4c5d6e7f9"), nil},
		{MatchNVMe(testNQN, 2, "", ""), nil},
		{MatchNVMe(testNQN, 0, "", ""), nil},
		{MatchNVMe("nqn.2014-08.org.berth:vol-2", 2, "", ""), []string{"nvme1n2"}},
		{MatchNVMe("nqn.2014-08.org.berth:vol-2", 2, "5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", ""), nil},
		{MatchLoop("/var/lib/berth/volumes/pvc-1/disk.img"), []string{"loop0"}},
		{MatchLoop("/var/lib/berth/volumes/pvc-2/disk.img"), nil},
		{MatchLoop(""), nil},
		{MatchMultipath("36001405a1b2c3d4e5f60718293a4b5c6"), []string{"dm-0"}},
		{MatchMultipath(testWWID), []string{"dm-0"}},
		{MatchMultipath(testWWID, "sdb", "sdc"), []string{"dm-0"}},
		{MatchMultipath(testWWID, "sdb", "sdd"), nil},
		// Created but not resumed: not usable yet.
		{MatchMultipath("3600140500000000000000000000000b"), nil},
	} {
		var got []string
		for name, d := range all {
			if tc.m.Match(d) {
				got = append(got, name)
			}
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s matched %q, want %q", tc.m, got, tc.want)
		}
	}
	if MatchLoop("x").Match(nil) || MatchSCSI("1:0:0:0", "").Match(nil) || MatchSCSIAddress(1, 0, 0, 0).Match(nil) {
		t.Error("a matcher matched nil")
	}
}

// A scan for a SCSI address reads the whole device of that disk only:
// the others are ruled out by their SCSI device link.
func TestScanSCSIAddressReadsOneDevice(t *testing.T) {
	t.Parallel()
	_, roots := fakeSys(t)
	for _, tc := range []struct {
		m    Matcher
		want string
	}{
		{MatchSCSIAddress(2, 0, 0, 1), "sdb"},
		{MatchSCSIAddress(3, 0, -1, 1), "sdc"},
		{MatchSCSIAddress(4, 0, 0, 1), ""},
	} {
		var read []string
		kind := tc.m.(kindMatcher).kind()
		if err := roots.scanBlock(kind, tc.m, func(d *Device) bool {
			read = append(read, d.Name)
			return tc.m.Match(d)
		}); err != nil {
			t.Fatal(err)
		}
		want := []string{tc.want}
		if tc.want == "" {
			want = nil
		}
		if !slices.Equal(read, want) {
			t.Errorf("scan for %s read %q, want only %q", tc.m, read, want)
		}
	}
}

func TestNormalizeWWID(t *testing.T) {
	for in, want := range map[string]string{
		"naa.6001405ABC":                   "naa.6001405abc",
		"36001405abc":                      "naa.6001405abc",
		"mpath-36001405abc":                "naa.6001405abc",
		"0x6001405abc":                     "naa.6001405abc",
		"wwn-0x6001405abc":                 "naa.6001405abc",
		"6001405a1b2c3d4e5f60718293a4b5c6": "naa.6001405a1b2c3d4e5f60718293a4b5c6",
		"eui.0025385B71B0F0A1":             "eui.0025385b71b0f0a1",
		"20025385b71b0f0a1":                "eui.0025385b71b0f0a1",
		"t10.ACME    DISK0001  ":           "t10.ACME_DISK0001",
		"1ACME____DISK0001":                "t10.ACME_DISK0001",
		"8iqn.2003-01.org.x:lun1":          "iqn.2003-01.org.x:lun1",
		" naa.6001405abc\n":                "naa.6001405abc",
		"":                                 "",
	} {
		if got := NormalizeWWID(in); got != want {
			t.Errorf("NormalizeWWID(%q) = %q, want %q", in, got, want)
		}
	}
}
