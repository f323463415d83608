package nvmeof

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-csi/berth/internal/errdefs"
)

// DefaultHostDir is where nvme-cli keeps the host's identity.
const DefaultHostDir = "/etc/nvme"

// HostIdentity is the NQN and ID this host presents to targets. Arrays
// register hosts by NQN, so berth uses the same identity as nvme-cli.
type HostIdentity struct {
	NQN string
	ID  string // a UUID
}

// LoadHostIdentity returns the host identity kept in dir/hostnqn and
// dir/hostid, the files nvme-cli and the kernel's users share.
//
//   - Both files present: they are used as they are (after validation).
//   - hostnqn present, hostid missing: the hostid is the UUID of a
//     nqn.2014-08.org.nvmexpress:uuid:<uuid> hostnqn, else a new random
//     UUID; it is written to dir/hostid.
//   - hostid present, hostnqn missing: the hostnqn is
//     nqn.2014-08.org.nvmexpress:uuid:<hostid>; it is written.
//   - Neither: a random UUID (version 4) becomes both, hostid written first.
//
// Files are written 0644 through a temporary file, fsync and a link
// that never replaces a file another program wrote at the same moment
// (its content wins). A file with an invalid identity is an error
// wrapping errdefs.ErrFailedPrecondition: berth never overwrites it.
func LoadHostIdentity(dir string) (HostIdentity, error) {
	id, err := ReadHostIdentity(dir)
	if err != nil {
		return id, err
	}
	nqn, hid := id.NQN, id.ID
	switch {
	case nqn != "" && hid != "":
	case nqn != "":
		u, ok := nqnUUID(nqn)
		if !ok {
			if u, err = newUUID(); err != nil {
				return id, err
			}
		}
		if hid, err = writeIdentityFile(dir, "hostid", u); err != nil {
			return id, err
		}
	default:
		if hid == "" {
			u, err := newUUID()
			if err != nil {
				return id, err
			}
			if hid, err = writeIdentityFile(dir, "hostid", u); err != nil {
				return id, err
			}
		}
		if nqn, err = writeIdentityFile(dir, "hostnqn", uuidNQNPrefix+hid); err != nil {
			return id, err
		}
	}
	return HostIdentity{NQN: nqn, ID: hid}, nil
}

// ReadHostIdentity reads dir/hostnqn and dir/hostid as LoadHostIdentity
// does, but writes neither: a missing or empty file leaves its field
// empty. A file with an invalid identity is an *IdentityFileError. The
// hostid is in lower case.
func ReadHostIdentity(dir string) (HostIdentity, error) {
	var id HostIdentity
	nqn, err := readIdentityFile(dir, "hostnqn")
	if err != nil {
		return id, err
	}
	hid, err := readIdentityFile(dir, "hostid")
	if err != nil {
		return id, err
	}
	if nqn != "" {
		if err := ValidateNQN("hostnqn", nqn); err != nil {
			return id, &IdentityFileError{Path: filepath.Join(dir, "hostnqn"), What: "host NQN", Err: err}
		}
	}
	if hid != "" {
		if err := validateUUID("hostid", hid); err != nil {
			return id, &IdentityFileError{Path: filepath.Join(dir, "hostid"), What: "host ID", Err: err}
		}
		hid = strings.ToLower(hid)
	}
	return HostIdentity{NQN: nqn, ID: hid}, nil
}

// IdentityFileError is a host identity file that holds no valid identity.
// berth never overwrites such a file. It wraps
// errdefs.ErrFailedPrecondition only: the content's error (an invalid
// argument where it came from a request) is text here.
type IdentityFileError struct {
	Path string // the file
	What string // "host NQN", "host ID"
	Err  error  // what is wrong with its content
}

func (e *IdentityFileError) Error() string {
	return fmt.Sprintf("%s holds no valid %s (%v); fix or remove it", e.Path, e.What, e.Err)
}

func (e *IdentityFileError) Unwrap() error { return errdefs.ErrFailedPrecondition }

// NQNUUID returns the UUID an NQN of the form
// nqn.2014-08.org.nvmexpress:uuid:<uuid> carries, in lower case.
func NQNUUID(nqn string) (string, bool) { return nqnUUID(nqn) }

// UUIDNQN is the host NQN that carries uuid.
func UUIDNQN(uuid string) string { return uuidNQNPrefix + uuid }

// readIdentityFile returns the trimmed content of dir/name, "" when the
// file is missing or empty.
func readIdentityFile(dir, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read host identity: %w", err)
	}
	return string(bytes.TrimSpace(b)), nil
}

// writeIdentityFile creates dir/name holding v and returns v. When
// another process created the file first, its (valid) content is
// returned instead.
func writeIdentityFile(dir, name, v string) (_ string, retErr error) {
	final := filepath.Join(dir, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("write %s: %w", final, err)
	}
	f, err := os.CreateTemp(dir, "."+name+"-")
	if err != nil {
		return "", fmt.Errorf("write %s: %w", final, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.WriteString(v + "\n"); err != nil {
		f.Close()
		return "", fmt.Errorf("write %s: %w", final, err)
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return "", fmt.Errorf("write %s: %w", final, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return "", fmt.Errorf("write %s: %w", final, err)
	}
	if err := f.Close(); err != nil {
		return "", fmt.Errorf("write %s: %w", final, err)
	}
	// A hard link fails instead of replacing a file that appeared since
	// it was read: the identity another tool just created wins.
	if err := os.Link(tmp, final); err != nil {
		if !errors.Is(err, fs.ErrExist) {
			return "", fmt.Errorf("write %s: %w", final, err)
		}
		got, rerr := readIdentityFile(dir, name)
		if rerr != nil {
			return "", rerr
		}
		if got != "" {
			return got, nil
		}
		// An empty file holds no identity: replace it.
		if err := os.Rename(tmp, final); err != nil {
			return "", fmt.Errorf("write %s: %w", final, err)
		}
	}
	if d, err := os.Open(dir); err == nil {
		err = d.Sync()
		d.Close()
		if err != nil {
			return "", fmt.Errorf("write %s: sync directory: %w", final, err)
		}
	}
	return v, nil
}

// newUUID returns a random (version 4, RFC 9562) UUID in lower case.
func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generate UUID: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// checkHostConflict returns an error when id would pair its hostnqn
// with another hostid, or its hostid with another hostnqn, than an
// existing fabrics controller does: the kernel refuses such a connect
// ("found same hostid ... but different hostnqn") with a bare EINVAL.
func checkHostConflict(ctrls []Controller, id HostIdentity) error {
	for _, c := range ctrls {
		if c.HostNQN == "" || c.HostID == "" || c.Deleting() {
			continue
		}
		sameNQN := c.HostNQN == id.NQN
		sameID := strings.EqualFold(c.HostID, id.ID)
		switch {
		case sameNQN && !sameID:
			return fmt.Errorf("host identity: controller %s already uses hostnqn %s with hostid %s, not %s; the kernel refuses a second hostid for one hostnqn (check /etc/nvme/hostid): %w",
				c.Name, c.HostNQN, c.HostID, id.ID, errdefs.ErrFailedPrecondition)
		case sameID && !sameNQN:
			return fmt.Errorf("host identity: controller %s already uses hostid %s with hostnqn %s, not %s; the kernel refuses a second hostnqn for one hostid (check /etc/nvme/hostnqn): %w",
				c.Name, c.HostID, c.HostNQN, id.NQN, errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}
