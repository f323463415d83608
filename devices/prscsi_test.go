package devices

import (
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

// prInKeys builds READ KEYS parameter data.
func prInKeys(gen uint32, keys ...uint64) []byte {
	b := make([]byte, 8+8*len(keys))
	binary.BigEndian.PutUint32(b[0:4], gen)
	binary.BigEndian.PutUint32(b[4:8], uint32(8*len(keys)))
	for i, k := range keys {
		binary.BigEndian.PutUint64(b[8+8*i:], k)
	}
	return b
}

func TestParsePRInKeys(t *testing.T) {
	gen, keys, err := parsePRInKeys(prInKeys(7, 0xb3e7000000000001, 0xb3e7000000000001, 0x1234))
	if err != nil || gen != 7 || !slices.Equal(keys, []uint64{0xb3e7000000000001, 0xb3e7000000000001, 0x1234}) {
		t.Fatalf("parse: gen %d keys %x err %v", gen, keys, err)
	}
	if _, keys, err := parsePRInKeys(prInKeys(0)); err != nil || len(keys) != 0 {
		t.Fatalf("no keys: %x %v", keys, err)
	}
	cut := prInKeys(1, 1, 2)[:16] // the allocation length cut the list
	if _, _, err := parsePRInKeys(cut); err == nil {
		t.Fatal("a list cut short parsed")
	}
	odd := prInKeys(1, 1)
	binary.BigEndian.PutUint32(odd[4:8], 7)
	if _, _, err := parsePRInKeys(odd); err == nil {
		t.Fatal("additional length 7 parsed")
	}
	if _, _, err := parsePRInKeys([]byte{0, 0, 0}); err == nil {
		t.Fatal("3 bytes parsed")
	}
	if n, ok := prInLength(prInKeys(1, 1, 2, 3)); !ok || n != 32 {
		t.Fatalf("prInLength %d %v", n, ok)
	}
}

func TestParsePRInReservation(t *testing.T) {
	// Reserved: generation 9, key 0xb3e7…42, LU scope, type 5 (Write
	// Exclusive – Registrants Only).
	b := make([]byte, 24)
	binary.BigEndian.PutUint32(b[0:4], 9)
	binary.BigEndian.PutUint32(b[4:8], 16)
	binary.BigEndian.PutUint64(b[8:16], 0xb3e7000000000042)
	b[21] = 0x05
	r, err := parsePRInReservation(b)
	if err != nil || r.Generation != 9 || r.Holder != 0xb3e7000000000042 || r.Type != PRWriteExclusiveRegOnly {
		t.Fatalf("reserved: %+v %v", r, err)
	}
	for code, want := range map[byte]PRType{1: PRWriteExclusive, 3: PRExclusiveAccess, 6: PRExclusiveAccessRegOnly, 7: PRWriteExclusiveAllRegs, 8: PRExclusiveAccessAllRegs} {
		b[21] = code
		if r, err := parsePRInReservation(b); err != nil || r.Type != want {
			t.Errorf("type code %d: %+v %v, want %d", code, r, err, want)
		}
	}
	b[21] = 0x02 // obsolete
	if _, err := parsePRInReservation(b); err == nil {
		t.Error("type 2 parsed")
	}
	b[21] = 0x15 // element scope
	if _, err := parsePRInReservation(b); err == nil {
		t.Error("scope 1 parsed")
	}
	// Not reserved: the header alone.
	free := []byte{0, 0, 0, 3, 0, 0, 0, 0}
	if r, err := parsePRInReservation(free); err != nil || r.Holder != 0 || r.Type != 0 || r.Generation != 3 {
		t.Fatalf("not reserved: %+v %v", r, err)
	}
	if _, err := parsePRInReservation(b[:20]); err == nil {
		t.Error("a cut reservation parsed")
	}
}

func TestSenseAndResults(t *testing.T) {
	fixed := make([]byte, 18)
	fixed[0], fixed[2], fixed[12] = 0x70, 0x05, 0x20 // ILLEGAL REQUEST, INVALID COMMAND OPERATION CODE
	if err := sgStatusError(scsiStatusCheckCondition, 0, 0x08, fixed); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Errorf("illegal request: %v", err)
	}
	desc := []byte{0x72, 0x06, 0x29, 0x00}
	if err := sgStatusError(scsiStatusCheckCondition, 0, 0x08, desc); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("unit attention: %v", err)
	}
	if err := sgStatusError(scsiStatusReservationConflict, 0, 0, nil); !errors.Is(err, ErrReservationConflict) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("conflict: %v", err)
	}
	if err := sgStatusError(0, 0x01, 0, nil); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("host status: %v", err)
	}
	if err := sgStatusError(0, 0, 0, nil); err != nil {
		t.Errorf("good: %v", err)
	}
	if err := scsiResultError(0x18).classify(); !errors.Is(err, ErrReservationConflict) {
		t.Errorf("result 0x18: %v", err)
	}
	if err := scsiResultError(0x70000).classify(); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("result host byte: %v", err)
	}
	if err := nvmeStatusError(0x83); !errors.Is(err, ErrReservationConflict) {
		t.Errorf("NVMe 0x83: %v", err)
	}
	if err := nvmeStatusError(0x4001); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Errorf("NVMe 0x4001: %v", err)
	}
}

func TestPRInCDB(t *testing.T) {
	want := []byte{0x5e, 0x01, 0, 0, 0, 0, 0, 0x04, 0x00, 0}
	if got := prInCDB(prInReadReservation, 1024); !slices.Equal(got, want) {
		t.Fatalf("cdb % x, want % x", got, want)
	}
}

func FuzzParsePRIn(f *testing.F) {
	f.Add(prInKeys(1, 1, 2))
	f.Add([]byte{0, 0, 0, 1, 0, 0, 0, 16, 0xb3, 0xe7, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 5, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		if _, keys, err := parsePRInKeys(b); err == nil && 8+8*len(keys) > len(b) {
			t.Fatalf("%d keys from %d bytes", len(keys), len(b))
		}
		if r, err := parsePRInReservation(b); err == nil && r.Type == 0 && r.Holder != 0 {
			t.Fatalf("holder %x without a type", r.Holder)
		}
		parseSense(b)
	})
}
