package devices

import (
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// nvmePassthruCmd is struct nvme_passthru_cmd of linux/nvme_ioctl.h (72
// bytes, the same layout on every 64-bit architecture).
type nvmePassthruCmd struct {
	opcode      uint8
	flags       uint8
	rsvd1       uint16
	nsid        uint32
	cdw2        uint32
	cdw3        uint32
	metadata    uint64
	addr        uint64
	metadataLen uint32
	dataLen     uint32
	cdw10       uint32
	cdw11       uint32
	cdw12       uint32
	cdw13       uint32
	cdw14       uint32
	cdw15       uint32
	timeoutMS   uint32
	result      uint32
}

const (
	// nvmeIoctlID is NVME_IOCTL_ID, _IO('N', 0x40): the namespace ID of
	// a namespace block device, as the ioctl's return value.
	nvmeIoctlID = 0x4e40
	// nvmeIoctlIOCmd is NVME_IOCTL_IO_CMD, _IOWR('N', 0x43, struct
	// nvme_passthru_cmd).
	nvmeIoctlIOCmd = 0xc0484e43
	// nvmeIoctlAdminCmd is NVME_IOCTL_ADMIN_CMD, _IOWR('N', 0x41, struct
	// nvme_admin_cmd), the same struct.
	nvmeIoctlAdminCmd = 0xc0484e41

	nvmeAdminIdentify = 0x06 // Identify; cdw10 CNS says what
)

// nvmeAdminCmd sends the admin command cmd with the data buffer buf
// through the NVMe admin passthrough ioctl of f: a controller's character
// device, or a namespace's block device (the kernel sends it to the
// namespace's controller, or to one of its head's). A status the
// controller answers gives an error wrapping errNVMeStatus.
func nvmeAdminCmd(f *os.File, cmd *nvmePassthruCmd, buf []byte) error {
	cmd.addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
	cmd.dataLen = uint32(len(buf))
	status, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nvmeIoctlAdminCmd, uintptr(unsafe.Pointer(cmd)))
	runtime.KeepAlive(buf)
	switch {
	case errno == unix.EWOULDBLOCK:
		return errNoPath(errno)
	case errno != 0:
		return errno
	case status != 0:
		return fmt.Errorf("NVMe status %#x: %w", status, errNVMeStatus)
	}
	return nil
}

// nvmeIOCmd sends cmd with the data buffer buf (from or to the device, as
// the opcode says) through the NVMe I/O passthrough ioctl.
func nvmeIOCmd(f *os.File, cmd *nvmePassthruCmd, buf []byte) error {
	cmd.addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
	cmd.dataLen = uint32(len(buf))
	status, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nvmeIoctlIOCmd, uintptr(unsafe.Pointer(cmd)))
	runtime.KeepAlive(buf)
	if errno != 0 {
		if errno == unix.ENOTTY {
			return fmt.Errorf("no NVMe passthrough (%w): %w", errno, errdefs.ErrUnsupported)
		}
		if errno == unix.EWOULDBLOCK {
			return errNoPath(errno)
		}
		return errno
	}
	if status != 0 {
		return nvmeStatusError(uint32(status))
	}
	return nil
}

// nvmeNamespaceID returns the namespace ID of the namespace block device f.
func nvmeNamespaceID(f *os.File) (uint32, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nvmeIoctlID, 0)
	if errno != 0 {
		if errno == unix.ENOTTY || errno == unix.EINVAL {
			return 0, fmt.Errorf("namespace ID of %s: not an NVMe namespace (%w): %w", f.Name(), errno, errdefs.ErrUnsupported)
		}
		if errno == unix.EWOULDBLOCK {
			return 0, fmt.Errorf("namespace ID of %s: %w", f.Name(), errNoPath(errno))
		}
		return 0, fmt.Errorf("namespace ID of %s: %w", f.Name(), errno)
	}
	return uint32(r), nil
}

// errNoPath is the EWOULDBLOCK of an ioctl on a native-multipath head
// that has no live path to send it down (its controllers reconnecting).
func errNoPath(errno unix.Errno) error {
	return fmt.Errorf("no live path to the namespace (%w): %w", errno, errdefs.ErrUnavailable)
}
