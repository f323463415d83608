package fs

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"strings"
)

// blkid exit statuses (util-linux blkid(8)).
const (
	blkidExitNotFound   = 2 // no signature found (also: device unreadable)
	blkidExitUsage      = 4 // usage or other error
	blkidExitAmbivalent = 8 // low-level probe found conflicting signatures
)

// parseBlkidExport parses `blkid -o export` output: KEY=value lines, with
// the value's special characters escaped by a backslash. Only the first
// device's block is read (up to the first empty line).
func parseBlkidExport(r io.Reader) (map[string]string, error) {
	tags := make(map[string]string)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 64*1024)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			if len(tags) > 0 {
				break
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || k == "" || strings.ContainsFunc(k, func(r rune) bool {
			return !(r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_')
		}) {
			return nil, fmt.Errorf("parse blkid output: malformed line %q", line)
		}
		tags[k] = unescapeBlkid(v)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("parse blkid output: %w", err)
	}
	return tags, nil
}

// unescapeBlkid removes the backslashes blkid puts before shell-special
// characters in export output.
func unescapeBlkid(v string) string {
	if !strings.Contains(v, `\`) {
		return v
	}
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '\\' && i+1 < len(v) {
			i++
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// signatureFromTags turns blkid tags into a Signature. Partition entry
// tags (PART_ENTRY_*, which describe the device as a partition of a
// larger disk) and topology tags are not signatures on the device.
func signatureFromTags(tags map[string]string) Signature {
	s := Signature{
		Type:           tags["TYPE"],
		Usage:          tags["USAGE"],
		UUID:           tags["UUID"],
		Label:          tags["LABEL"],
		PartitionTable: tags["PTTYPE"],
	}
	if s.Type == "" && s.PartitionTable != "" {
		s.Type = s.PartitionTable
		s.Usage = usagePartitionTable
		s.UUID = tags["PTUUID"]
	}
	if s.Type == "" && s.Usage != "" {
		// A superblock blkid could classify but not name.
		s.Type = "unknown-" + s.Usage
	}
	return s
}

// signatureFromBlkid interprets a finished `blkid -p -o export` run.
func signatureFromBlkid(exitCode int, stdout []byte) (sig Signature, found bool, err error) {
	switch exitCode {
	case 0:
		tags, err := parseBlkidExport(bytes.NewReader(stdout))
		if err != nil {
			return Signature{}, false, err
		}
		sig = signatureFromTags(tags)
		return sig, !sig.Blank(), nil
	case blkidExitNotFound:
		return Signature{}, false, nil
	case blkidExitAmbivalent:
		return Signature{Type: typeAmbivalent}, true, nil
	}
	return Signature{}, false, fmt.Errorf("blkid: unexpected exit status %d", exitCode)
}

// zeroBlock is compared against: bytes.Equal is vectorised.
var zeroBlock [4096]byte

// firstNonZero returns the offset of the first non-zero byte in b, or -1.
func firstNonZero(b []byte) int {
	for off := 0; off < len(b); off += len(zeroBlock) {
		chunk := b[off:min(off+len(zeroBlock), len(b))]
		if bytes.Equal(chunk, zeroBlock[:len(chunk)]) {
			continue
		}
		for i, c := range chunk {
			if c != 0 {
				return off + i
			}
		}
	}
	return -1
}
