package keyring

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
)

// ProcKeys lists the keys the caller may view.
const ProcKeys = "/proc/keys"

// List reads ProcKeys. A kernel without key retention (CONFIG_KEYS) or
// without /proc/keys (CONFIG_KEYS_PROC... not set) is ErrUnsupported.
func List() ([]Key, error) {
	f, err := os.Open(ProcKeys)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("list kernel keys: %s does not exist (a kernel without CONFIG_KEYS): %w", ProcKeys, errdefs.ErrUnsupported)
	}
	if err != nil {
		return nil, fmt.Errorf("list kernel keys: %w", err)
	}
	defer f.Close()
	return ParseProcKeys(f)
}

// Possessor acts on one keyring as its possessor: from a thread whose
// thread keyring links it. Keys added without further permissions give
// their owner only the right to view them; possession gives search,
// read, write and link (the possessor bits of the default permissions),
// which is what tlshd has too once it links the same keyring into its
// session keyring.
type Possessor struct {
	ring int
}

// Possess runs fn on an OS thread of its own whose thread keyring links
// ring. The thread ends with fn (it is never unlocked), and with it its
// thread keyring: no other goroutine ever runs with the possession.
func Possess(ring int, fn func(p Possessor) error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread exits with this goroutine.
		if _, err := unix.KeyctlGetKeyringID(unix.KEY_SPEC_THREAD_KEYRING, true); err != nil {
			done <- fmt.Errorf("keyring: create the thread keyring: %w", err)
			return
		}
		if _, err := unix.KeyctlInt(unix.KEYCTL_LINK, ring, unix.KEY_SPEC_THREAD_KEYRING, 0, 0); err != nil {
			done <- fmt.Errorf("keyring: link keyring %08x into the thread keyring: %w", ring, err)
			return
		}
		done <- fn(Possessor{ring: ring})
	}()
	return <-done
}

// Search returns the serial of a key of type typ and description desc
// in the keyring or a keyring linked below it, or 0 when there is none.
func (p Possessor) Search(typ, desc string) (int, error) {
	id, err := unix.KeyctlSearch(p.ring, typ, desc, 0)
	if errors.Is(err, unix.ENOKEY) || errors.Is(err, unix.EKEYREVOKED) || errors.Is(err, unix.EKEYEXPIRED) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("keyring: search %s %q: %w", typ, desc, err)
	}
	return id, nil
}

// Read returns the payload of key id.
func (p Possessor) Read(id int) ([]byte, error) {
	buf := make([]byte, 512)
	n, err := unix.KeyctlBuffer(unix.KEYCTL_READ, id, buf, 0)
	if err != nil {
		return nil, fmt.Errorf("keyring: read key %08x: %w", id, err)
	}
	if n > len(buf) {
		return nil, fmt.Errorf("keyring: read key %08x: %d bytes, more than %d", id, n, len(buf))
	}
	return buf[:n], nil
}

// Add adds a key of type typ with description desc and payload to the
// keyring and returns its serial. A key of the same type and description
// in the keyring is replaced in place (its serial stays), as add_key(2)
// does.
func (p Possessor) Add(typ, desc string, payload []byte) (int, error) {
	id, err := unix.AddKey(typ, desc, payload, p.ring)
	if err != nil {
		return 0, fmt.Errorf("keyring: add %s key %q: %w", typ, desc, err)
	}
	return id, nil
}

// AddKeyring returns the keyring called name linked in the keyring,
// creating it when there is none.
func (p Possessor) AddKeyring(name string) (int, error) {
	if id, err := p.Search("keyring", name); err != nil || id != 0 {
		return id, err
	}
	id, err := unix.AddKey("keyring", name, nil, p.ring)
	if err != nil {
		return 0, fmt.Errorf("keyring: add keyring %q: %w", name, err)
	}
	return id, nil
}

// Sub returns a Possessor of keyring id, which must be linked below this
// one (so that the thread possesses it too).
func (p Possessor) Sub(id int) Possessor { return Possessor{ring: id} }

// Unlink removes key id from the keyring. The kernel frees the key once
// nothing else links or holds it (a controller connected with it holds
// it until the controller is deleted). A key not linked there any more
// is success.
func (p Possessor) Unlink(id int) error {
	_, err := unix.KeyctlInt(unix.KEYCTL_UNLINK, id, p.ring, 0, 0)
	if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOKEY) && !errors.Is(err, unix.EKEYREVOKED) {
		return fmt.Errorf("keyring: unlink key %08x: %w", id, err)
	}
	return nil
}

// Links returns the keys linked directly in the keyring, described.
func (p Possessor) Links() ([]Key, error) {
	buf := make([]byte, 4096)
	n, err := unix.KeyctlBuffer(unix.KEYCTL_READ, p.ring, buf, 0)
	if err != nil {
		return nil, fmt.Errorf("keyring: read keyring %08x: %w", p.ring, err)
	}
	if n > len(buf) {
		buf = make([]byte, n)
		if n, err = unix.KeyctlBuffer(unix.KEYCTL_READ, p.ring, buf, 0); err != nil {
			return nil, fmt.Errorf("keyring: read keyring %08x: %w", p.ring, err)
		}
	}
	var keys []Key
	for i := 0; i+4 <= n && i+4 <= len(buf); i += 4 {
		id := int(int32(uint32(buf[i]) | uint32(buf[i+1])<<8 | uint32(buf[i+2])<<16 | uint32(buf[i+3])<<24))
		d, err := unix.KeyctlString(unix.KEYCTL_DESCRIBE, id)
		if err != nil {
			continue // gone meanwhile, or not ours to see
		}
		k, ok := parseDescribe(d)
		if !ok {
			continue
		}
		k.Serial = id
		keys = append(keys, k)
	}
	return keys, nil
}
