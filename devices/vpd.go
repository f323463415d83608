package devices

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"
)

// Designator is one designation descriptor of SCSI VPD page 0x83 (Device
// Identification), as found in /sys/block/X/device/vpd_pg83.
type Designator struct {
	CodeSet     uint8 // 1 binary, 2 ASCII, 3 UTF-8
	Association uint8 // 0 logical unit, 1 target port, 2 target device
	Type        uint8 // 1 T10 vendor ID, 2 EUI-64, 3 NAA, 8 SCSI name string, …
	Value       []byte
}

// Designator types of SPC-4 table 459 that identify a logical unit.
const (
	desigT10         = 0x1
	desigEUI64       = 0x2
	desigNAA         = 0x3
	desigSCSIName    = 0x8
	assocLogicalUnit = 0
)

// ParseVPD83 parses a VPD page 0x83 as the kernel exports it in vpd_pg83
// (the whole page, header included).
func ParseVPD83(page []byte) ([]Designator, error) {
	if len(page) < 4 {
		return nil, fmt.Errorf("VPD page 0x83: %d bytes, shorter than its header", len(page))
	}
	if page[1] != 0x83 {
		return nil, fmt.Errorf("VPD page code %#x, want 0x83", page[1])
	}
	n := int(binary.BigEndian.Uint16(page[2:4]))
	body := page[4:]
	if n > len(body) {
		return nil, fmt.Errorf("VPD page 0x83: length %d, only %d bytes present", n, len(body))
	}
	body = body[:n]
	var out []Designator
	for len(body) > 0 {
		if len(body) < 4 {
			return nil, fmt.Errorf("VPD page 0x83: truncated designation descriptor (%d bytes)", len(body))
		}
		l := int(body[3])
		if 4+l > len(body) {
			return nil, fmt.Errorf("VPD page 0x83: designator of %d bytes, only %d present", l, len(body)-4)
		}
		out = append(out, Designator{
			CodeSet:     body[0] & 0x0f,
			Association: (body[1] >> 4) & 0x3,
			Type:        body[1] & 0x0f,
			Value:       body[4 : 4+l],
		})
		body = body[4+l:]
	}
	return out, nil
}

// Text returns the designator in the kernel's WWID form ("naa.…", "eui.…",
// "t10.…", or the SCSI name string itself), or "" for designators that do not
// name a logical unit.
func (d Designator) Text() string {
	if d.Association != assocLogicalUnit || len(d.Value) == 0 {
		return ""
	}
	switch d.Type {
	case desigNAA:
		return "naa." + hex.EncodeToString(d.Value)
	case desigEUI64:
		return "eui." + hex.EncodeToString(d.Value)
	case desigT10:
		if d.CodeSet != 2 && d.CodeSet != 3 {
			return ""
		}
		return "t10." + strings.TrimRight(printable(d.Value), " ")
	case desigSCSIName:
		if d.CodeSet != 3 {
			return ""
		}
		return strings.TrimRight(printable(d.Value), "\x00 ")
	}
	return ""
}

// rank orders designators like the kernel's scsi_vpd_lun_id: NAA IEEE
// Registered Extended, EUI-64 16 and 12 bytes, NAA IEEE Registered, other NAA
// and EUI-64, a SCSI name string, and last the T10 vendor ID. A SCSI name
// string longer than 16 bytes beats all of them.
func (d Designator) rank() int {
	switch d.Type {
	case desigSCSIName:
		if len(d.Value) > 16 {
			return 100
		}
		return 30
	case desigNAA:
		switch d.Value[0] >> 4 {
		case 6:
			return 90
		case 5:
			return 60
		}
		return 50
	case desigEUI64:
		switch len(d.Value) {
		case 16:
			return 80
		case 12:
			return 70
		}
		return 40
	case desigT10:
		return 10
	}
	return 0
}

// PreferredWWID returns the designator the kernel would export as wwid, in
// text form, or "" when the page has no logical-unit designator.
func PreferredWWID(ds []Designator) string {
	best, bestRank := "", -1
	for _, d := range ds {
		t := d.Text()
		if t == "" {
			continue
		}
		if r := d.rank(); r > bestRank {
			best, bestRank = t, r
		}
	}
	return best
}

func printable(b []byte) string {
	var sb strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		if c < 0x20 || c > 0x7e {
			fmt.Fprintf(&sb, "\\x%02x", c)
			continue
		}
		sb.WriteByte(c)
	}
	return sb.String()
}
