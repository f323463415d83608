package devices

import (
	"testing"
	"unsafe"
)

// struct nvme_passthru_cmd is 72 bytes, and NVME_IOCTL_IO_CMD and
// NVME_IOCTL_ADMIN_CMD encode it.
func TestNVMePassthruLayout(t *testing.T) {
	if n := unsafe.Sizeof(nvmePassthruCmd{}); n != 72 {
		t.Fatalf("nvmePassthruCmd is %d bytes, want 72", n)
	}
	const iowr = 3 << 30
	if want := uint(iowr | 72<<16 | 'N'<<8 | 0x43); nvmeIoctlIOCmd != want {
		t.Errorf("nvmeIoctlIOCmd %#x, want %#x", nvmeIoctlIOCmd, want)
	}
	if want := uint(iowr | 72<<16 | 'N'<<8 | 0x41); nvmeIoctlAdminCmd != want {
		t.Errorf("nvmeIoctlAdminCmd %#x, want %#x", nvmeIoctlAdminCmd, want)
	}
	for _, f := range []struct {
		name string
		off  uintptr
		want uintptr
	}{
		{"nsid", unsafe.Offsetof(nvmePassthruCmd{}.nsid), 4},
		{"addr", unsafe.Offsetof(nvmePassthruCmd{}.addr), 24},
		{"data_len", unsafe.Offsetof(nvmePassthruCmd{}.dataLen), 36},
		{"cdw10", unsafe.Offsetof(nvmePassthruCmd{}.cdw10), 40},
		{"timeout_ms", unsafe.Offsetof(nvmePassthruCmd{}.timeoutMS), 64},
		{"result", unsafe.Offsetof(nvmePassthruCmd{}.result), 68},
	} {
		if f.off != f.want {
			t.Errorf("offset of %s: %d, want %d", f.name, f.off, f.want)
		}
	}
}
