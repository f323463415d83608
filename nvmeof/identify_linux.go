package nvmeof

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// nvmePassthruCmd is struct nvme_passthru_cmd of <linux/nvme_ioctl.h>.
type nvmePassthruCmd struct {
	Opcode      uint8
	Flags       uint8
	Rsvd1       uint16
	NSID        uint32
	Cdw2, Cdw3  uint32
	Metadata    uint64
	Addr        uint64
	MetadataLen uint32
	DataLen     uint32
	Cdw10       uint32
	Cdw11       uint32
	Cdw12       uint32
	Cdw13       uint32
	Cdw14       uint32
	Cdw15       uint32
	TimeoutMs   uint32
	Result      uint32
}

const (
	// nvmeIoctlAdminCmd is NVME_IOCTL_ADMIN_CMD: _IOWR('N', 0x41, struct nvme_admin_cmd).
	nvmeIoctlAdminCmd    = 0xC0000000 | uintptr(unsafe.Sizeof(nvmePassthruCmd{}))<<16 | 'N'<<8 | 0x41
	nvmeAdminIdentify    = 0x06
	identifyCNSNamespace = 0x00
)

// identifyNamespaceSize asks the controller ctrl (its character device
// under devRoot) for the size of namespace nsid with an Identify
// Namespace admin command: the size the target reports now, whether or
// not the kernel has taken it yet.
func identifyNamespaceSize(devRoot, ctrl string, nsid uint32) (int64, error) {
	f, err := os.OpenFile(filepath.Join(devRoot, ctrl), os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("identify namespace %d: %w", nsid, err)
	}
	defer f.Close()
	buf := make([]byte, identifyNamespaceLen)
	cmd := nvmePassthruCmd{
		Opcode:  nvmeAdminIdentify,
		NSID:    nsid,
		Addr:    uint64(uintptr(unsafe.Pointer(&buf[0]))),
		DataLen: identifyNamespaceLen,
		Cdw10:   identifyCNSNamespace,
	}
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nvmeIoctlAdminCmd, uintptr(unsafe.Pointer(&cmd)))
	runtime.KeepAlive(buf)
	if errno != 0 {
		return 0, fmt.Errorf("identify namespace %d on %s: %w", nsid, ctrl, errno)
	}
	if r != 0 {
		return 0, fmt.Errorf("identify namespace %d on %s: NVMe status %#x", nsid, ctrl, r)
	}
	return parseNamespaceSize(buf)
}
