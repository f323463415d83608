package sysfs

import (
	"os"
	"path/filepath"
)

// Root is where a sysfs tree is mounted. The zero value is the host's,
// /sys; At names another (the host's sysfs mounted elsewhere, or a fake
// tree in tests, see package sysfstest). Every path below takes its
// elements relative to the root: Path("class", "block", "sda").
type Root struct{ dir string }

// At is the sysfs tree mounted at dir; "" is /sys.
func At(dir string) Root { return Root{dir: dir} }

// Path joins elem to the root.
func (r Root) Path(elem ...string) string {
	dir := r.dir
	if dir == "" {
		dir = "/sys"
	}
	return filepath.Join(append([]string{dir}, elem...)...)
}

// ReadAttr reads the attribute at elem, as the function ReadAttr does.
func (r Root) ReadAttr(elem ...string) (string, error) { return ReadAttr(r.Path(elem...)) }

// OpenDir opens the directory at elem to read its attributes (see Dir).
func (r Root) OpenDir(elem ...string) (*Dir, error) { return OpenDir(r.Path(elem...)) }

// List returns the names in the directory at elem, sorted.
func (r Root) List(elem ...string) ([]string, error) {
	ents, err := os.ReadDir(r.Path(elem...))
	if err != nil {
		return nil, err
	}
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.Name()
	}
	return names, nil
}

// Readlink returns the target of the symbolic link at elem.
func (r Root) Readlink(elem ...string) (string, error) { return os.Readlink(r.Path(elem...)) }
