package devices

import (
	"encoding/binary"
	"testing"
)

func identifyData(nsze uint64, nlbaf, flbas byte, lbads map[int]byte) []byte {
	b := make([]byte, identifyNamespaceLen)
	binary.LittleEndian.PutUint64(b[0:8], nsze)
	b[25], b[26] = nlbaf, flbas
	for i, v := range lbads {
		b[128+4*i+2] = v
	}
	return b
}

func TestParseNamespaceSize(t *testing.T) {
	for _, tc := range []struct {
		name string
		data []byte
		want int64
	}{
		{"512-byte blocks", identifyData(131072, 0, 0, map[int]byte{0: 9}), 64 << 20},
		{"second format, 4 KiB", identifyData(16384, 1, 1, map[int]byte{0: 9, 1: 12}), 64 << 20},
		{"format index above 15", identifyData(16384, 19, 0x20|0x02, map[int]byte{18: 12, 2: 9}), 64 << 20},
		{"metadata settings bit ignored", identifyData(131072, 0, 0x10, map[int]byte{0: 9}), 64 << 20},
		{"inactive namespace", identifyData(0, 0, 0, map[int]byte{0: 9}), -1},
		{"format out of range", identifyData(8, 0, 3, map[int]byte{0: 9}), -1},
		{"block size 0", identifyData(8, 0, 0, nil), -1},
		{"short", make([]byte, 100), -1},
	} {
		got, err := parseNamespaceSize(tc.data)
		if tc.want < 0 {
			if err == nil {
				t.Errorf("%s: %d, want an error", tc.name, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %d, %v; want %d", tc.name, got, err, tc.want)
		}
	}
}
