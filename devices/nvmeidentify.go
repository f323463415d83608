package devices

import (
	"encoding/binary"
	"fmt"
)

const (
	// nvmeIdentifyNamespace is CNS 00h of Identify: Identify Namespace.
	nvmeIdentifyNamespace = 0x00
	// identifyNamespaceLen is the size of the Identify Namespace data
	// structure (NVMe base specification, CNS 00h).
	identifyNamespaceLen = 4096
)

// parseNamespaceSize returns the size in bytes a controller reports for a
// namespace in its Identify Namespace data: the namespace size in logical
// blocks (NSZE, bytes 0-7) times the block size of the format in use
// (FLBAS, byte 26, indexes the LBA formats at byte 128; LBADS is the
// power of two of the block size).
func parseNamespaceSize(b []byte) (int64, error) {
	if len(b) < identifyNamespaceLen {
		return 0, fmt.Errorf("identify namespace: %d bytes, want %d", len(b), identifyNamespaceLen)
	}
	nsze := binary.LittleEndian.Uint64(b[0:8])
	nlbaf := int(b[25]) + 1 // a 0's based count
	flbas := b[26]
	format := int(flbas & 0x0f)
	if nlbaf > 16 {
		format |= int(flbas>>5&0x03) << 4
	}
	if format >= nlbaf || format >= 64 {
		return 0, fmt.Errorf("identify namespace: format %d in use, but %d formats", format, nlbaf)
	}
	lbads := b[128+4*format+2]
	if lbads < 9 || lbads > 30 {
		return 0, fmt.Errorf("identify namespace: block size 2^%d bytes", lbads)
	}
	if nsze == 0 || nsze > 1<<(63-uint(lbads)) {
		return 0, fmt.Errorf("identify namespace: size %d blocks (inactive namespace?)", nsze)
	}
	return int64(nsze) << lbads, nil
}
