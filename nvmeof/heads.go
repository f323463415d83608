package nvmeof

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/internal/sysfs"
)

// Head is a namespace block device as sysfs describes it: with native
// multipath the subsystem's head (nvme0n1 under nvme-subsys0), else the
// controller's own namespace device.
type Head struct {
	Name  string // "nvme0n1"
	NQN   string
	NSID  uint32
	UUID  string // lower case, "" when the target reports none
	NGUID string // lower case, "" when the target reports none
	Size  int64  // bytes
}

// matches reports whether h is the namespace v asks for.
func (h *Head) matches(v *Volume) bool {
	if h.NQN != v.NQN {
		return false
	}
	if v.NSID != 0 && h.NSID != v.NSID {
		return false
	}
	if v.UUID != "" && h.UUID != v.UUID {
		return false
	}
	if v.NGUID != "" && h.NGUID != v.NGUID {
		return false
	}
	return true
}

// readHeads lists the NVMe namespace devices in block/ of the tree that
// belong to subsystem nqn ("" = all). Hidden multipath path devices
// (nvme0c1n1) are not heads and are left out.
func (s sysTree) readHeads(nqn string) ([]Head, error) {
	names, err := s.root.List("block")
	if err != nil {
		return nil, fmt.Errorf("list block devices: %w", err)
	}
	var out []Head
	for _, name := range names {
		if !headNameRE.MatchString(name) {
			continue
		}
		h, err := s.readHead(s.root.Path("block", name))
		if sysfs.Gone(err) {
			continue // removed while listing
		}
		if err != nil {
			return nil, err
		}
		if nqn == "" || h.NQN == nqn {
			out = append(out, h)
		}
	}
	return out, nil
}

func (tree sysTree) readHead(dir string) (Head, error) {
	h := Head{Name: filepath.Base(dir)}
	fail := func(err error) (Head, error) { return h, fmt.Errorf("read namespace %s: %w", h.Name, err) }
	nqn, err := tree.readAttr(filepath.Join(dir, "device"), "subsysnqn")
	if err != nil {
		return fail(err)
	}
	h.NQN = nqn
	s, err := tree.readAttr(dir, "nsid")
	if err != nil {
		return fail(err)
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return fail(fmt.Errorf("nsid %q: %w", s, err))
	}
	h.NSID = uint32(n)
	// uuid and nguid are hidden when the target reports none.
	if s, err := tree.readAttr(dir, "uuid"); err == nil {
		h.UUID = normalizeZeroID(s)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fail(err)
	}
	if s, err := tree.readAttr(dir, "nguid"); err == nil {
		h.NGUID = normalizeZeroID(s)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fail(err)
	}
	if h.Size, err = tree.readSize(dir); err != nil {
		return fail(err)
	}
	return h, nil
}

// readSize reads the size attribute (512-byte sectors) of a block device.
func (tree sysTree) readSize(dir string) (int64, error) {
	s, err := tree.readAttr(dir, "size")
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("size %q: not a sector count", s)
	}
	return n * 512, nil
}

// normalizeZeroID lower-cases a UUID or NGUID; all zeros (none) is "".
func normalizeZeroID(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	if strings.Trim(s, "0-") == "" {
		return ""
	}
	if g, ok := normalizeNGUID(s); ok {
		return g
	}
	return s
}
