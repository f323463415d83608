package devices

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// marshalUdevMessage builds a message in udev's netlink format: the
// "libudev" header (magic big endian, sizes in host order, filter hashes)
// followed by NUL-terminated properties.
func marshalUdevMessage(env []string) []byte {
	var props bytes.Buffer
	for _, kv := range env {
		props.WriteString(kv)
		props.WriteByte(0)
	}
	const hdrSize = 40
	hdr := make([]byte, hdrSize)
	copy(hdr, udevPrefix)
	binary.BigEndian.PutUint32(hdr[8:], udevMagic)
	binary.NativeEndian.PutUint32(hdr[12:], hdrSize)
	binary.NativeEndian.PutUint32(hdr[16:], hdrSize)
	binary.NativeEndian.PutUint32(hdr[20:], uint32(props.Len()))
	binary.BigEndian.PutUint32(hdr[24:], 0x3f0b4c4e) // subsystem hash
	binary.BigEndian.PutUint32(hdr[28:], 0x1b5e2d44) // devtype hash
	return append(hdr, props.Bytes()...)
}

func kernelMessage(action, devpath string, env ...string) []byte {
	b := []byte(action + "@" + devpath + "\x00")
	for _, kv := range env {
		b = append(b, kv...)
		b = append(b, 0)
	}
	return b
}

func readSample(t testing.TB, name string) []byte {
	b, err := os.ReadFile(filepath.Join("testdata", "uevent", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseKernelSamples(t *testing.T) {
	for _, tc := range []struct {
		file    string
		want    Event
		devName string
	}{
		{"kernel-loop-change-attach.bin", Event{Source: SourceKernel, Action: "change", DevPath: "/devices/virtual/block/loop0",
			Subsystem: "block", DevType: "disk", DevName: "loop0", Major: 7, Minor: 0, HasDevNum: true, Seqnum: 828}, "loop0"},
		{"kernel-loop-change-media.bin", Event{Source: SourceKernel, Action: "change", DevPath: "/devices/virtual/block/loop0",
			Subsystem: "block", DevType: "disk", DevName: "loop0", Major: 7, Minor: 0, HasDevNum: true, Seqnum: 830}, "loop0"},
		{"kernel-loop-add.bin", Event{Source: SourceKernel, Action: "add", DevPath: "/devices/virtual/block/loop99",
			Subsystem: "block", DevType: "disk", DevName: "loop99", Major: 7, Minor: 99, HasDevNum: true, Seqnum: 832}, "loop99"},
		{"kernel-loop-remove.bin", Event{Source: SourceKernel, Action: "remove", DevPath: "/devices/virtual/block/loop99",
			Subsystem: "block", DevType: "disk", DevName: "loop99", Major: 7, Minor: 99, HasDevNum: true, Seqnum: 834}, "loop99"},
		{"kernel-bdi-add.bin", Event{Source: SourceKernel, Action: "add", DevPath: "/devices/virtual/bdi/7:99",
			Subsystem: "bdi", Seqnum: 831}, "7:99"},
	} {
		ev, err := ParseUevent(readSample(t, tc.file))
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		got := *ev
		got.Env = nil
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.file, got, tc.want)
		}
		if ev.Name() != tc.devName {
			t.Errorf("%s: Name() = %q, want %q", tc.file, ev.Name(), tc.devName)
		}
	}
	ev, _ := ParseUevent(readSample(t, "kernel-loop-change-media.bin"))
	if ev.Env["DISK_MEDIA_CHANGE"] != "1" || ev.Env["DISKSEQ"] != "15" {
		t.Errorf("env %v", ev.Env)
	}
}

func TestParseSCSIAndNVMeKernelEvents(t *testing.T) {
	ev, err := ParseUevent(kernelMessage("add", "/devices/platform/host2/session1/target2:0:0/2:0:0:1/block/sdb",
		"ACTION=add", "DEVPATH=/devices/platform/host2/session1/target2:0:0/2:0:0:1/block/sdb", "SUBSYSTEM=block",
		"MAJOR=8", "MINOR=16", "DEVNAME=sdb", "DEVTYPE=disk", "DISKSEQ=21", "SEQNUM=2145"))
	if err != nil || ev.Name() != "sdb" || ev.Major != 8 || ev.Minor != 16 || ev.Seqnum != 2145 {
		t.Errorf("scsi add: %+v %v", ev, err)
	}
	ev, err = ParseUevent(kernelMessage("add", "/devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1",
		"ACTION=add", "DEVPATH=/devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1", "SUBSYSTEM=block",
		"MAJOR=259", "MINOR=0", "DEVNAME=nvme0n1", "DEVTYPE=disk", "DISKSEQ=30", "SEQNUM=3001"))
	if err != nil || ev.Name() != "nvme0n1" || ev.Major != 259 {
		t.Errorf("nvme add: %+v %v", ev, err)
	}
}

// udev-loop-change.bin was sent by systemd-udevd 252 (Debian 12) in a test
// guest, after "change" was written to loop7's uevent attribute.
func TestParseUdevSample(t *testing.T) {
	ev, err := ParseUevent(readSample(t, "udev-loop-change.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if ev.Source != SourceUdev || ev.Action != "change" || ev.DevPath != "/devices/virtual/block/loop7" ||
		ev.Subsystem != "block" || ev.DevName != "/dev/loop7" || ev.Major != 7 || ev.Minor != 7 || ev.Seqnum != 1771 ||
		ev.Env["SYNTH_UUID"] != "0" || ev.Env["DEVLINKS"] != "/dev/disk/by-diskseq/213" || ev.Env["SYSTEMD_READY"] != "0" {
		t.Errorf("udev sample: %+v", ev)
	}
}

func TestParseUdevMessage(t *testing.T) {
	env := []string{
		"ACTION=add", "DEVPATH=/devices/platform/host2/session1/target2:0:0/2:0:0:1/block/sdb",
		"SUBSYSTEM=block", "DEVNAME=/dev/sdb", "DEVTYPE=disk", "DISKSEQ=21", "SEQNUM=2145",
		"USEC_INITIALIZED=81234567", "MAJOR=8", "MINOR=16",
		"ID_SERIAL=36001405a1b2c3d4e5f60718293a4b5c6", "ID_WWN=0x6001405a1b2c3d4e",
		"DEVLINKS=/dev/disk/by-id/wwn-0x6001405a1b2c3d4e5f60718293a4b5c6 /dev/disk/by-path/ip-127.0.0.1:3260-iscsi-iqn.2003-01.org.linux-iscsi.t:vol1-lun-1",
		"TAGS=:systemd:", "CURRENT_TAGS=:systemd:",
	}
	msg := marshalUdevMessage(env)
	ev, err := ParseUevent(msg)
	if err != nil {
		t.Fatal(err)
	}
	if ev.Source != SourceUdev || ev.Action != "add" || ev.Name() != "sdb" || ev.DevName != "/dev/sdb" ||
		ev.Major != 8 || ev.Minor != 16 || ev.Seqnum != 2145 || ev.Env["ID_SERIAL"] != "36001405a1b2c3d4e5f60718293a4b5c6" ||
		!strings.Contains(ev.Env["DEVLINKS"], "by-path") {
		t.Errorf("udev add: %+v", ev)
	}
	if len(ev.Env) != len(env) {
		t.Errorf("%d properties, want %d", len(ev.Env), len(env))
	}
	// A header larger than ours (a newer udev): the offset is what counts.
	big := marshalUdevMessage(env)
	props := big[40:]
	hdr := append(append([]byte(nil), big[:40]...), make([]byte, 8)...)
	binary.NativeEndian.PutUint32(hdr[12:], 48)
	binary.NativeEndian.PutUint32(hdr[16:], 48)
	if ev, err := ParseUevent(append(hdr, props...)); err != nil || ev.Name() != "sdb" {
		t.Errorf("larger header: %+v %v", ev, err)
	}
}

func TestParseUeventErrors(t *testing.T) {
	good := marshalUdevMessage([]string{"ACTION=add", "DEVPATH=/devices/virtual/block/loop0", "SUBSYSTEM=block"})
	badMagic := append([]byte(nil), good...)
	badMagic[8] = 0
	badOff := append([]byte(nil), good...)
	binary.NativeEndian.PutUint32(badOff[16:], 4000)
	badLen := append([]byte(nil), good...)
	binary.NativeEndian.PutUint32(badLen[20:], 0xffffffff)
	for name, msg := range map[string][]byte{
		"empty":           nil,
		"no nul":          []byte("add@/devices/x"),
		"no at":           []byte("add /devices/x\x00ACTION=add\x00"),
		"relative path":   kernelMessage("add", "devices/x", "ACTION=add", "DEVPATH=devices/x", "SUBSYSTEM=block"),
		"header mismatch": kernelMessage("add", "/devices/x", "ACTION=remove", "DEVPATH=/devices/x", "SUBSYSTEM=block"),
		"no subsystem":    kernelMessage("add", "/devices/x", "ACTION=add", "DEVPATH=/devices/x"),
		"not key=value":   kernelMessage("add", "/devices/x", "ACTION=add", "DEVPATH=/devices/x", "SUBSYSTEM=block", "JUNK"),
		"empty key":       kernelMessage("add", "/devices/x", "ACTION=add", "DEVPATH=/devices/x", "SUBSYSTEM=block", "=1"),
		"bad seqnum":      kernelMessage("add", "/devices/x", "ACTION=add", "DEVPATH=/devices/x", "SUBSYSTEM=block", "SEQNUM=x"),
		"bad major":       kernelMessage("add", "/devices/x", "ACTION=add", "DEVPATH=/devices/x", "SUBSYSTEM=block", "MAJOR=-1", "MINOR=0"),
		"dotdot":          kernelMessage("add", "/devices/../x", "ACTION=add", "DEVPATH=/devices/../x", "SUBSYSTEM=block"),
		"udev short":      good[:20],
		"udev magic":      badMagic,
		"udev offset":     badOff,
		"udev length":     badLen,
	} {
		if ev, err := ParseUevent(msg); err == nil {
			t.Errorf("%s: parsed %+v, want an error", name, ev)
		}
	}
}

func FuzzParseUevent(f *testing.F) {
	for _, name := range []string{"kernel-loop-change-attach.bin", "kernel-loop-add.bin", "kernel-bdi-add.bin", "kernel-loop-remove.bin"} {
		f.Add(readSample(f, name))
	}
	f.Add(readSample(f, "udev-loop-change.bin"))
	f.Add(marshalUdevMessage([]string{"ACTION=change", "DEVPATH=/devices/virtual/block/dm-0", "SUBSYSTEM=block", "MAJOR=253", "MINOR=0", "SEQNUM=7"}))
	f.Fuzz(func(t *testing.T, msg []byte) {
		ev, err := ParseUevent(msg)
		if err != nil {
			return
		}
		if ev.Action == "" || ev.Subsystem == "" || !strings.HasPrefix(ev.DevPath, "/") {
			t.Fatalf("accepted an event without action, subsystem or absolute devpath: %+v", ev)
		}
		if ev.Source == SourceKernel {
			// Re-encoding a kernel event and parsing it gives the same event.
			var env []string
			for k, v := range ev.Env {
				env = append(env, k+"="+v)
			}
			again, err := ParseUevent(kernelMessage(ev.Action, ev.DevPath, env...))
			if err != nil || again.Seqnum != ev.Seqnum || again.Major != ev.Major || len(again.Env) != len(ev.Env) {
				t.Fatalf("re-encoded event differs: %+v %v", again, err)
			}
		}
	})
}
