package devices

import (
	"encoding/binary"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

// nvmeRegistrant is one registrant of a hand-built Reservation Report.
type nvmeRegistrant struct {
	cntlid uint16
	holds  bool
	key    uint64
	hostID [16]byte
}

// nvmeReport builds an extended Reservation Status data structure as a
// target sends it: count registrants in the header, the given entries
// after it (fewer when the buffer was too small), size bytes in all (0:
// just what the entries need).
func nvmeReport(gen uint32, rtype uint8, count int, regs []nvmeRegistrant, size int) []byte {
	if size == 0 {
		size = 64 + 64*len(regs)
	}
	b := make([]byte, size)
	binary.LittleEndian.PutUint32(b[0:], gen)
	b[4] = rtype
	binary.LittleEndian.PutUint16(b[5:], uint16(count))
	b[9] = 0 // PTPLS: nvmet persists nothing
	for i, r := range regs {
		e := b[64+64*i:]
		if len(e) < 64 {
			break
		}
		binary.LittleEndian.PutUint16(e[0:], r.cntlid)
		if r.holds {
			e[2] = 1
		}
		binary.LittleEndian.PutUint64(e[8:], r.key)
		copy(e[16:32], r.hostID[:])
	}
	return b
}

func TestParseNVMeReservationReport(t *testing.T) {
	hostA := [16]byte{0x0a, 0x0a, 0x0a, 0x0a, 15: 0x0a}
	hostB := [16]byte{0x0b, 0x0b, 0x0b, 0x0b, 15: 0x0b}
	a := nvmeRegistrant{cntlid: 0xffff, key: 0xbe27a0000000000a, hostID: hostA}
	b := nvmeRegistrant{cntlid: 0xffff, key: 0xbe27a0000000000b, hostID: hostB}
	aHolds := a
	aHolds.holds = true
	bHolds := b
	bHolds.holds = true

	for _, tc := range []struct {
		name     string
		in       []byte
		want     Reservation
		wantNeed int
		wantErr  string
	}{{
		name:     "nothing registered",
		in:       nvmeReport(7, 0, 0, nil, 4096),
		want:     Reservation{Generation: 7, Keys: []uint64{}},
		wantNeed: 64,
	}, {
		name:     "two registrants, no reservation",
		in:       nvmeReport(9, 0, 2, []nvmeRegistrant{a, b}, 4096),
		want:     Reservation{Generation: 9, Keys: []uint64{a.key, b.key}},
		wantNeed: 192,
	}, {
		name: "WE-RO held by A",
		in:   nvmeReport(10, 3, 2, []nvmeRegistrant{aHolds, b}, 0),
		want: Reservation{Generation: 10, Keys: []uint64{a.key, b.key},
			Holder: a.key, Type: PRWriteExclusiveRegOnly},
		wantNeed: 192,
	}, {
		name: "WE-RO held by B, listed second",
		in:   nvmeReport(11, 3, 2, []nvmeRegistrant{a, bHolds}, 0),
		want: Reservation{Generation: 11, Keys: []uint64{a.key, b.key},
			Holder: b.key, Type: PRWriteExclusiveRegOnly},
		wantNeed: 192,
	}, {
		name: "generation in little endian",
		in:   nvmeReport(0x01020304, 1, 1, []nvmeRegistrant{aHolds}, 0),
		want: Reservation{Generation: 0x01020304, Keys: []uint64{a.key},
			Holder: a.key, Type: PRWriteExclusive},
		wantNeed: 128,
	}, {
		name: "write exclusive, all registrants: holder 0",
		in:   nvmeReport(12, 5, 2, []nvmeRegistrant{aHolds, bHolds}, 0),
		want: Reservation{Generation: 12, Keys: []uint64{a.key, b.key},
			Type: PRWriteExclusiveAllRegs},
		wantNeed: 192,
	}, {
		name: "exclusive access, all registrants, holder bits clear: holder 0",
		in:   nvmeReport(13, 6, 2, []nvmeRegistrant{a, b}, 0),
		want: Reservation{Generation: 13, Keys: []uint64{a.key, b.key},
			Type: PRExclusiveAccessAllRegs},
		wantNeed: 192,
	}, {
		name: "exclusive access, registrants only",
		in:   nvmeReport(14, 4, 1, []nvmeRegistrant{aHolds}, 0),
		want: Reservation{Generation: 14, Keys: []uint64{a.key},
			Holder: a.key, Type: PRExclusiveAccessRegOnly},
		wantNeed: 128,
	}, {
		name: "exclusive access",
		in:   nvmeReport(15, 2, 1, []nvmeRegistrant{aHolds}, 0),
		want: Reservation{Generation: 15, Keys: []uint64{a.key},
			Holder: a.key, Type: PRExclusiveAccess},
		wantNeed: 128,
	}, {
		// A holder that is not registered (a holder of a type whose
		// holder need not be a registrant is not in NVMe: reservations
		// go with registration): type set, nobody's bit. Holder 0.
		name:     "reserved, no holder bit",
		in:       nvmeReport(16, 3, 1, []nvmeRegistrant{a}, 0),
		want:     Reservation{Generation: 16, Keys: []uint64{a.key}, Type: PRWriteExclusiveRegOnly},
		wantNeed: 128,
	}, {
		name:     "buffer too small: the keys that fit and the size needed",
		in:       nvmeReport(17, 3, 3, []nvmeRegistrant{aHolds, b}, 64+2*64),
		want:     Reservation{Generation: 17, Keys: []uint64{a.key, b.key}, Holder: a.key, Type: PRWriteExclusiveRegOnly},
		wantNeed: 256,
	}, {
		name:     "buffer cut inside an entry",
		in:       nvmeReport(18, 0, 2, []nvmeRegistrant{a, b}, 64+64+10),
		want:     Reservation{Generation: 18, Keys: []uint64{a.key}},
		wantNeed: 192,
	}, {
		name:    "short header",
		in:      make([]byte, 63),
		wantErr: "63 bytes",
	}, {
		name:     "unknown reservation type",
		in:       nvmeReport(19, 7, 1, []nvmeRegistrant{aHolds}, 0),
		wantNeed: 128,
		wantErr:  "unknown NVMe reservation type 7",
	}, {
		name:     "a holder bit with no reservation",
		in:       nvmeReport(20, 0, 1, []nvmeRegistrant{aHolds}, 0),
		wantNeed: 128,
		wantErr:  "reservation type is 0",
	}, {
		name:     "two holders of a one-holder type",
		in:       nvmeReport(21, 3, 2, []nvmeRegistrant{aHolds, bHolds}, 0),
		wantNeed: 192,
		wantErr:  "2 registrants hold",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, need, err := parseNVMeReservationReport(tc.in)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				if need != tc.wantNeed {
					t.Errorf("need %d, want %d", need, tc.wantNeed)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Generation != tc.want.Generation || got.Holder != tc.want.Holder ||
				got.Type != tc.want.Type || !slices.Equal(got.Keys, tc.want.Keys) {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
			if need != tc.wantNeed {
				t.Errorf("need %d, want %d", need, tc.wantNeed)
			}
		})
	}
}

// The NVMe reservation types are the block layer's numbers.
func TestPRTypeFromNVMe(t *testing.T) {
	for rtype, want := range map[uint8]PRType{
		0: 0, 1: PRWriteExclusive, 2: PRExclusiveAccess, 3: PRWriteExclusiveRegOnly,
		4: PRExclusiveAccessRegOnly, 5: PRWriteExclusiveAllRegs, 6: PRExclusiveAccessAllRegs,
	} {
		if got, err := prTypeFromNVMe(rtype); err != nil || got != want {
			t.Errorf("prTypeFromNVMe(%d) = %d, %v; want %d", rtype, got, err, want)
		}
	}
	for _, rtype := range []uint8{7, 8, 0x80, 0xff} {
		if _, err := prTypeFromNVMe(rtype); err == nil {
			t.Errorf("prTypeFromNVMe(%d): no error", rtype)
		}
	}
}

// FuzzParseNVMeReservationReport: any bytes a target sends give a
// reservation or an error, never a panic; keys never exceed what the
// buffer holds, and the size asked for is the header's count.
func FuzzParseNVMeReservationReport(f *testing.F) {
	f.Add(nvmeReport(1, 3, 2, []nvmeRegistrant{{key: 1, holds: true}, {key: 2}}, 0))
	f.Add(nvmeReport(1, 5, 1, []nvmeRegistrant{{key: 1, holds: true}}, 100))
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, need, err := parseNVMeReservationReport(b)
		if err != nil {
			return
		}
		n := int(binary.LittleEndian.Uint16(b[5:7]))
		if need != 64+64*n {
			t.Fatalf("need %d for %d registrants", need, n)
		}
		if len(r.Keys) > (len(b)-64)/64 || len(r.Keys) > n {
			t.Fatalf("%d keys from %d bytes, %d registrants", len(r.Keys), len(b), n)
		}
		if r.Holder != 0 && !slices.Contains(r.Keys, r.Holder) {
			t.Fatalf("holder %x not among the keys %x", r.Holder, r.Keys)
		}
		if r.Type == 0 && r.Holder != 0 {
			t.Fatalf("holder %x of no reservation", r.Holder)
		}
	})
}

// A PR ioctl on an NVMe device that the target refuses with a
// reservation conflict returns PR_STS_RESERVATION_CONFLICT (0x18) on
// Linux 6.2 and later: a conflict, not the NVMe status 0x18 (Host
// Identifier Inconsistent Format, "unsupported"), which made the agent
// say the target had no reservations. The raw NVMe statuses of older
// kernels keep their meaning.
func TestNVMePRResultError(t *testing.T) {
	nvme := &PR{dev: &Device{Path: "/dev/nvme0n1", ID: Identity{Kind: KindNVMe}}}
	for _, tc := range []struct {
		r                   int
		conflict, unsupport bool
		unavailable         bool
	}{
		{r: 0x18, conflict: true},       // PR_STS_RESERVATION_CONFLICT (6.2+)
		{r: 0x83, conflict: true},       // NVMe Reservation Conflict (before 6.2)
		{r: 0x4083, conflict: true},     // the same with Do Not Retry
		{r: 0x4001, unsupport: true},    // Invalid Opcode: no reservations
		{r: 0x10000, unavailable: true}, // PR_STS_PATH_FAILED
		{r: 0xe0000, unavailable: true}, // PR_STS_RETRY_PATH_FAILURE
		{r: 0x06},                       // Internal Error: none of those
	} {
		err := nvme.prErr("register", scsiResultError(tc.r))
		if errors.Is(err, ErrReservationConflict) != tc.conflict || errors.Is(err, errdefs.ErrUnsupported) != tc.unsupport ||
			errors.Is(err, errdefs.ErrUnavailable) != tc.unavailable {
			t.Errorf("result %#x: %v; want conflict %t, unsupported %t, unavailable %t", tc.r, err, tc.conflict, tc.unsupport, tc.unavailable)
		}
	}
}

// The registrant with this host's host ID is found in a report: its key
// (0 too: a host left with key 0 is still a registrant).
func TestNVMeRegistrantKey(t *testing.T) {
	hostA := [16]byte{1, 15: 1}
	hostB := [16]byte{2, 15: 2}
	hostC := [16]byte{3, 15: 3}
	b := nvmeReport(4, 3, 2, []nvmeRegistrant{{key: 0xa, hostID: hostA, holds: true}, {key: 0, hostID: hostB}}, 0)
	for _, tc := range []struct {
		host [16]byte
		key  uint64
		ok   bool
	}{{hostA, 0xa, true}, {hostB, 0, true}, {hostC, 0, false}} {
		if k, ok := nvmeRegistrantKey(b, tc.host); k != tc.key || ok != tc.ok {
			t.Errorf("host %x: %#x %t, want %#x %t", tc.host, k, ok, tc.key, tc.ok)
		}
	}
	// A report cut short: only the entries that fit.
	short := nvmeReport(4, 3, 2, []nvmeRegistrant{{key: 0xa, hostID: hostA}}, 128)
	if _, ok := nvmeRegistrantKey(short, hostB); ok {
		t.Error("found a registrant beyond the buffer")
	}
}

// SCSI and NVMe namespaces are fenced: their reservation is read (an
// NVMe device that cannot be asked whether it has reservations, as this
// path that does not exist, too: the read says why).
func TestReservationReadable(t *testing.T) {
	for kind, want := range map[string]bool{KindSCSI: true, KindDM: true, KindNVMe: true, KindLoop: false, "": false} {
		if got := ReservationReadable(&Device{Path: "/dev/nonexistent-nvme", ID: Identity{Kind: kind}}); got != want {
			t.Errorf("%q: %t, want %t", kind, got, want)
		}
	}
}
