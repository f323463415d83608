package fs

import (
	"encoding/binary"
	"testing"
)

func TestParseFdinfo(t *testing.T) {
	got, err := parseFdinfo([]byte("pos:\t0\nflags:\t012000000\nmnt_id:\t45\nino:\t128\n"))
	if err != nil || got != (fdinfo{mntID: 45, ino: 128}) {
		t.Fatalf("parseFdinfo = %+v, %v; want mount 45, inode 128", got, err)
	}
	for _, bad := range []string{
		"pos:\t0\nflags:\t012000000\nmnt_id:\t45\n", // Linux < 5.14: no ino
		"mnt_id:\tx\nino:\t1\n",
		"",
	} {
		if got, err := parseFdinfo([]byte(bad)); err == nil {
			t.Errorf("parseFdinfo(%q) = %+v, want an error", bad, got)
		}
	}
}

func TestParseStatmount(t *testing.T) {
	b := make([]byte, 512)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], 512)
	ne.PutUint64(b[8:], statmountSBBasic|statmountMntBasic)
	ne.PutUint32(b[16:], 7)
	ne.PutUint32(b[20:], 3)
	ne.PutUint64(b[24:], xfsStatfsMagic)
	ne.PutUint64(b[40:], 0x80000047)
	ne.PutUint32(b[56:], 45)
	got, err := parseStatmount(b)
	if err != nil || got != (statmount{major: 7, minor: 3, mntIDOld: 45}) {
		t.Fatalf("parseStatmount = %+v, %v; want device 7:3, mount 45", got, err)
	}
	ne.PutUint64(b[8:], statmountSBBasic)
	if got, err := parseStatmount(b); err == nil {
		t.Errorf("parseStatmount without STATMOUNT_MNT_BASIC = %+v, want an error", got)
	}
	if got, err := parseStatmount(b[:32]); err == nil {
		t.Errorf("parseStatmount(32 bytes) = %+v, want an error", got)
	}
}
