package agent

import (
	"crypto/sha256"
	"encoding/binary"
)

// berthKeyPrefix is the top 16 bits of every reservation key berth
// makes. berth acts only on keys with it: a key without it is
// multipathd's, an operator's or another cluster's, and berth leaves it
// alone (a stage that finds one refuses, naming it).
const berthKeyPrefix = 0xB3E7

// NodeKey is the persistent-reservation key of the node nodeID: 0xB3E7
// in its top 16 bits, then the first 6 bytes (big endian) of
// SHA-256("berth-node:" + nodeID). It is stable across restarts and
// reinstalls, never 0, and any node (or authority) can compute another
// node's key from its ID.
func NodeKey(nodeID string) uint64 {
	h := sha256.Sum256([]byte("berth-node:" + nodeID))
	return berthKeyPrefix<<48 | binary.BigEndian.Uint64(h[:8])>>16
}

// IsBerthKey reports whether k is a key berth makes (NodeKey of some
// node).
func IsBerthKey(k uint64) bool { return k>>48 == berthKeyPrefix }
