package nvmefabrics

import (
	"fmt"
	"strconv"
	"strings"
)

// parseReply parses what /dev/nvme-fabrics returns after a
// successful connect: "instance=3,cntlid=1\n".
func parseReply(b []byte) (instance, cntlid int, err error) {
	s := strings.TrimRight(string(b), "\n\x00")
	instance, cntlid = -1, -1
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return 0, 0, fmt.Errorf("parse nvme-fabrics reply %q: %q is not key=value", s, kv)
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return 0, 0, fmt.Errorf("parse nvme-fabrics reply %q: %s is not a number", s, k)
		}
		switch k {
		case "instance":
			instance = n
		case "cntlid":
			cntlid = n
		}
	}
	if instance < 0 || cntlid < 0 {
		return 0, 0, fmt.Errorf("parse nvme-fabrics reply %q: want instance=N,cntlid=M", s)
	}
	return instance, cntlid, nil
}
