package devices

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// NVMeNamespaceSize asks the NVMe controller whose character device is at
// path for the size of namespace nsid with an Identify Namespace admin
// command: the size the target reports now, whether or not the kernel has
// taken it yet.
func NVMeNamespaceSize(path string, nsid uint32) (int64, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("identify namespace %d: %w", nsid, err)
	}
	defer f.Close()
	buf := make([]byte, identifyNamespaceLen)
	cmd := nvmePassthruCmd{opcode: nvmeAdminIdentify, nsid: nsid, cdw10: nvmeIdentifyNamespace}
	if err := nvmeAdminCmd(f, &cmd, buf); err != nil {
		return 0, fmt.Errorf("identify namespace %d on %s: %w", nsid, path, err)
	}
	return parseNamespaceSize(buf)
}
