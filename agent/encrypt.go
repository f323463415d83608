package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/internal/errdefs"
)

// Node-side encryption: a volume whose volume_context has encrypted=true
// is a LUKS2 device on the transport's device, opened with dm-crypt as
// the mapping mappingName(volume ID); the filesystem (or the raw block
// device published) is the mapping. The key names are ceph-csi's, so
// that a StorageClass and Secret written for it work unchanged.
const (
	ContextEncrypted                 = "encrypted"
	ContextEncryptionCipher          = "encryptionCipher"
	ContextEncryptionSectorSize      = "encryptionSectorSize"
	ContextEncryptionPBKDF           = "encryptionPBKDF"
	ContextEncryptionPBKDFMemory     = "encryptionPBKDFMemory"
	ContextEncryptionPBKDFIterations = "encryptionPBKDFIterations"
	// ContextEncryptionAllowDiscards "true" opens the mapping with
	// discards allowed, so that a trim reaches the storage (see
	// docs/volume-context.md for what it reveals).
	ContextEncryptionAllowDiscards = "encryptionAllowDiscards"
	// SecretEncryptionPassphrase is the node_stage_secrets key (and
	// node_expand_secrets key) of the LUKS passphrase.
	SecretEncryptionPassphrase = "encryptionPassphrase"
)

// encryptionOptionKeys are the volume_context keys that only an
// encrypted volume may have.
var encryptionOptionKeys = []string{ContextEncryptionCipher, ContextEncryptionSectorSize,
	ContextEncryptionPBKDF, ContextEncryptionPBKDFMemory, ContextEncryptionPBKDFIterations,
	ContextEncryptionAllowDiscards}

// parseEncryption reads the encryption settings of a volume_context:
// nil when the volume is not encrypted. Every value is checked here,
// before anything is done.
func parseEncryption(vctx map[string]string) (*fs.LUKSOptions, error) {
	v, ok := vctx[ContextEncrypted]
	var on bool
	switch {
	case !ok || v == "false":
	case v == "true":
		on = true
	default:
		return nil, errdefs.InvalidArgument("volume_context[%q] %q: want \"true\" or \"false\"", ContextEncrypted, v)
	}
	if !on {
		for _, k := range encryptionOptionKeys {
			if _, ok := vctx[k]; ok {
				return nil, errdefs.InvalidArgument("volume_context[%q]: given without %s=\"true\"", k, ContextEncrypted)
			}
		}
		return nil, nil
	}
	o := &fs.LUKSOptions{Cipher: vctx[ContextEncryptionCipher], PBKDF: vctx[ContextEncryptionPBKDF]}
	if _, ok := vctx[ContextEncryptionCipher]; ok && o.Cipher == "" {
		return nil, errdefs.InvalidArgument("volume_context[%q]: empty", ContextEncryptionCipher)
	}
	if _, ok := vctx[ContextEncryptionPBKDF]; ok && o.PBKDF == "" {
		return nil, errdefs.InvalidArgument("volume_context[%q]: empty", ContextEncryptionPBKDF)
	}
	switch d, ok := vctx[ContextEncryptionAllowDiscards]; {
	case !ok || d == "false":
	case d == "true":
		o.AllowDiscards = true
	default:
		return nil, errdefs.InvalidArgument("volume_context[%q] %q: want \"true\" or \"false\"", ContextEncryptionAllowDiscards, d)
	}
	for _, f := range []struct {
		key string
		dst *int
	}{
		{ContextEncryptionSectorSize, &o.SectorSize},
		{ContextEncryptionPBKDFMemory, &o.PBKDFMemoryKiB},
		{ContextEncryptionPBKDFIterations, &o.PBKDFIterations},
	} {
		s, ok := vctx[f.key]
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(s, 10, 32)
		if err != nil || n == 0 || n > 1<<31-1 || strconv.FormatUint(n, 10) != s {
			return nil, errdefs.InvalidArgument("volume_context[%q] %q: want a positive decimal number", f.key, s)
		}
		*f.dst = int(n)
	}
	if err := o.Validate(); err != nil {
		return nil, fmt.Errorf("volume_context: encryption: %w", err)
	}
	return o, nil
}

// passphraseOf returns the LUKS passphrase of a request's secrets.
func passphraseOf(secrets map[string]string) ([]byte, error) {
	p, ok := secrets[SecretEncryptionPassphrase]
	if !ok || p == "" {
		return nil, errdefs.InvalidArgument("secrets: an encrypted volume needs its passphrase in %q (the StorageClass's csi.storage.k8s.io/node-stage-secret-name)", SecretEncryptionPassphrase)
	}
	return []byte(p), nil
}

var mappingSafe = regexp.MustCompile(`^[A-Za-z0-9_.+-]{1,100}$`)

// mappingName is the dm-crypt mapping name of a volume: "berth-" and
// the volume ID when it is short and made of characters device-mapper
// names keep as they are, else "berth-sha256-" and a hash of it (within
// device-mapper's 127 characters). The name only names the mapping: a
// mapping is taken for the volume's only when it also sits on the
// volume's device (see findMapping).
func mappingName(id string) string {
	if mappingSafe.MatchString(id) && !strings.HasPrefix(id, "sha256-") {
		return "berth-" + id
	}
	sum := sha256.Sum256([]byte(id))
	return "berth-sha256-" + hex.EncodeToString(sum[:16])
}

// cryptHost is dm-crypt as the node service uses it; the real one is
// package fs (cryptsetup) and devices.
type cryptHost interface {
	Check() error
	Probe(ctx context.Context, devPath string) (fs.Signature, error)
	Format(ctx context.Context, devPath string, passphrase []byte, o fs.LUKSOptions) error
	Open(ctx context.Context, devPath, name string, passphrase []byte, allowDiscards bool) error
	TestPassphrase(ctx context.Context, devPath string, passphrase []byte) error
	Close(ctx context.Context, name string) error
	Resize(ctx context.Context, name string, passphrase []byte) error
	Holders(name string) ([]string, error)
	// RemoveUnloaded removes the volume's mapping name when it is a
	// device-mapper device without a table (see
	// devices.Roots.RemoveUnloadedMap) and reports whether it did.
	RemoveUnloaded(name string) (bool, error)
}

// realCrypt reads the device-mapper control node and holders below roots.
type realCrypt struct{ roots devices.Roots }

var _ cryptHost = realCrypt{}

func (c realCrypt) Check() error {
	if err := fs.CheckCryptsetup(); err != nil {
		return err
	}
	return c.roots.CheckDeviceMapper()
}

func (realCrypt) Probe(ctx context.Context, devPath string) (fs.Signature, error) {
	return fs.Probe(ctx, devPath)
}

func (realCrypt) Format(ctx context.Context, devPath string, passphrase []byte, o fs.LUKSOptions) error {
	return fs.LUKSFormat(ctx, devPath, passphrase, o)
}

func (realCrypt) Open(ctx context.Context, devPath, name string, passphrase []byte, allowDiscards bool) error {
	return fs.LUKSOpen(ctx, devPath, name, passphrase, allowDiscards)
}

func (realCrypt) TestPassphrase(ctx context.Context, devPath string, passphrase []byte) error {
	return fs.LUKSTestPassphrase(ctx, devPath, passphrase)
}

func (realCrypt) Close(ctx context.Context, name string) error { return fs.LUKSClose(ctx, name) }

func (realCrypt) Resize(ctx context.Context, name string, passphrase []byte) error {
	return fs.LUKSResize(ctx, name, passphrase)
}

func (c realCrypt) Holders(name string) ([]string, error) { return c.roots.Holders(name) }

func (c realCrypt) RemoveUnloaded(name string) (bool, error) {
	return c.roots.RemoveUnloadedMap(name, func(uuid string) bool {
		return strings.HasPrefix(uuid, "CRYPT-LUKS") && strings.HasSuffix(uuid, "-"+name)
	})
}

// wrongPassphrase rewords cryptsetup's refusal of a passphrase.
func wrongPassphrase(id string, dev *devices.Device, err error) error {
	if errors.Is(err, errdefs.ErrPermissionDenied) {
		return fmt.Errorf("volume %q: the passphrase in secrets[%q] opens no key slot of the LUKS device %s; nothing was opened (check the Secret the StorageClass names): %w",
			id, SecretEncryptionPassphrase, dev.Path, err)
	}
	return fmt.Errorf("volume %q: %w", id, err)
}

// findMapping returns the dm-crypt mapping of the volume on dev: a
// device stacked on dev (dev's holders, the mapping's slaves) whose
// device-mapper UUID cryptsetup made for a LUKS mapping of the volume's
// name (CRYPT-LUKS2-<header UUID>-<name>). nil when dev is not open. A
// device held by anything else (another mapping, LVM, MD) is refused.
func (n *nodeServer) findMapping(rec *volumeRecord, dev *devices.Device) (*devices.Device, error) {
	holders, err := n.a.crypt.Holders(dev.Name)
	if err != nil {
		return nil, fmt.Errorf("volume %q: list what holds %s: %w", rec.VolumeID, dev.Path, err)
	}
	name := rec.Crypt.Name
	var found *devices.Device
	for _, h := range holders {
		d, err := n.a.lookup(h)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue // went away meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("volume %q: device %s holding %s: %w", rec.VolumeID, h, dev.Path, err)
		}
		if d.ID.Kind == devices.KindDM && d.ID.DMName == name &&
			strings.HasPrefix(d.ID.WWID, "CRYPT-LUKS") && strings.HasSuffix(d.ID.WWID, "-"+name) {
			found = d
			continue
		}
		what := d.Path
		if d.ID.DMName != "" {
			what = fmt.Sprintf("%s (device-mapper %s, uuid %q)", d.Path, d.ID.DMName, d.ID.WWID)
		}
		return nil, errdefs.FailedPrecondition("volume %q: its device %s is held by %s, not by the volume's mapping %s; berth does not use a device something else has open", rec.VolumeID, dev.Path, what, name)
	}
	return found, nil
}

// openEncrypted opens the LUKS2 device on dev as the volume's mapping
// and returns the mapping. A blank device is luksFormatted first (fresh:
// the mapping needs its filesystem, made without a probe, since what a
// new mapping reads is the decryption of the old zeros). A device with a
// LUKS header is opened with the passphrase; one holding anything else
// is refused. A mapping left open by an interrupted stage is found by
// dev's identity and taken once the passphrase is shown to open dev.
func (n *nodeServer) openEncrypted(ctx context.Context, rec *volumeRecord, dev *devices.Device, o fs.LUKSOptions, passphrase []byte, wasStaged bool) (mapping *devices.Device, fresh bool, err error) {
	id, c := rec.VolumeID, rec.Crypt
	log := logFrom(ctx, n.a.log)
	existing, err := n.findMapping(rec, dev)
	if err != nil {
		return nil, false, err
	}
	switch {
	case c.Formatting != nil:
		if !c.Formatting.identifies(dev) {
			return nil, false, errdefs.FailedPrecondition("volume %q: berth began to luksFormat device %s (%d:%d), which is not the device found now (%s): only a format of that same device is finished",
				id, c.Formatting.Path, c.Formatting.Major, c.Formatting.Minor, describeDevice(dev))
		}
		log.WarnContext(ctx, "finishing an encrypted format that was interrupted: berth found the device blank and began to luksFormat it before")
		if existing != nil {
			if err := n.a.crypt.Close(ctx, c.Name); err != nil {
				return nil, false, fmt.Errorf("volume %q: close the mapping of the interrupted format: %w", id, err)
			}
		}
	case existing != nil:
		// Open already: by this stage before a crash, or a stage
		// repeated. Unless the record says the stage finished with this
		// very mapping, the passphrase must still open the device.
		if !wasStaged || c.Mapping == nil || !c.Mapping.identifies(existing) {
			if err := n.a.crypt.TestPassphrase(ctx, dev.Path, passphrase); err != nil {
				return nil, false, wrongPassphrase(id, dev, err)
			}
		}
		return existing, false, nil
	default:
		sig, err := n.a.crypt.Probe(ctx, dev.Path)
		if err != nil {
			return nil, false, err
		}
		switch {
		case sig.Type == fs.TypeLUKS:
			if err := n.openLUKS(ctx, rec, dev, passphrase, o.AllowDiscards); err != nil {
				return nil, false, err
			}
			m, err := n.openedMapping(rec, dev)
			return m, false, err
		case !sig.Blank():
			return nil, false, errdefs.FailedPrecondition("volume %q: device %s holds %s, not a LUKS header; refusing to luksFormat a device that may hold data (check the volume: was it written unencrypted?)", id, dev.Path, sig)
		}
		// A blank device of a volume whose filesystem berth staged
		// before has lost its LUKS header and what it held.
		if mark, err := n.a.marks.get(id); err != nil {
			return nil, false, err
		} else if mark != nil {
			return nil, false, n.a.marks.filesystemGone(mark, dev.Path)
		}
		c.Formatting = deviceRecordOf(dev)
		if err := n.a.state.put(rec); err != nil {
			return nil, false, err
		}
	}
	if err := n.a.crypt.Format(ctx, dev.Path, passphrase, o); err != nil {
		if errors.Is(err, errdefs.ErrInvalidArgument) {
			// Refused before cryptsetup ran (a sector size the
			// device cannot take): the device is as it was.
			c.Formatting = nil
			err = errors.Join(err, n.a.state.put(rec))
		}
		return nil, false, fmt.Errorf("volume %q: %w", id, err)
	}
	log.InfoContext(ctx, "created LUKS2 header", slog.String("cipher", cmp(o.Cipher, fs.DefaultLUKSCipher)))
	if err := n.openLUKS(ctx, rec, dev, passphrase, o.AllowDiscards); err != nil {
		return nil, false, err
	}
	m, err := n.openedMapping(rec, dev)
	return m, true, err
}

func cmp(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// openLUKS opens dev as the volume's mapping. A device-mapper device of
// the mapping's name without a table, which a `cryptsetup open` that did
// not finish leaves behind (see devices.Roots.RemoveUnloadedMap) and
// which maps nothing, would refuse every open: it is removed, and the
// open tried once more.
func (n *nodeServer) openLUKS(ctx context.Context, rec *volumeRecord, dev *devices.Device, passphrase []byte, allowDiscards bool) error {
	name := rec.Crypt.Name
	err := n.a.crypt.Open(ctx, dev.Path, name, passphrase, allowDiscards)
	if err == nil || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		return n.openErrorIf(rec, dev, err)
	}
	removed, rerr := n.a.crypt.RemoveUnloaded(name)
	if rerr != nil || !removed {
		return n.openError(rec, dev, errors.Join(err, rerr))
	}
	logFrom(ctx, n.a.log).WarnContext(ctx, "removed a device-mapper device of the mapping's name without a table (left by an interrupted cryptsetup open)", slog.String("mapping", name))
	return n.openErrorIf(rec, dev, n.a.crypt.Open(ctx, dev.Path, name, passphrase, allowDiscards))
}

func (n *nodeServer) openErrorIf(rec *volumeRecord, dev *devices.Device, err error) error {
	if err == nil {
		return nil
	}
	return n.openError(rec, dev, err)
}

func (n *nodeServer) openError(rec *volumeRecord, dev *devices.Device, err error) error {
	if errors.Is(err, errdefs.ErrFailedPrecondition) {
		return fmt.Errorf("volume %q: open %s as %s: a device-mapper device of that name exists already, or the device is in use: %w", rec.VolumeID, dev.Path, rec.Crypt.Name, err)
	}
	return wrongPassphrase(rec.VolumeID, dev, err)
}

// openedMapping finds the mapping cryptsetup just opened on dev.
func (n *nodeServer) openedMapping(rec *volumeRecord, dev *devices.Device) (*devices.Device, error) {
	m, err := n.findMapping(rec, dev)
	if err == nil && m == nil {
		err = fmt.Errorf("volume %q: cryptsetup opened %s as %s, but no such mapping holds the device", rec.VolumeID, dev.Path, rec.Crypt.Name)
	}
	return m, err
}

// closeMapping closes the volume's mapping, found on the volume's
// device, or, with that device gone, as recorded (same number, same
// device-mapper UUID and name). Nothing open is success.
func (n *nodeServer) closeMapping(ctx context.Context, rec *volumeRecord) error {
	if rec.Crypt == nil {
		return nil
	}
	var m *devices.Device
	if dev := n.a.recordedDevice(rec.Device); dev != nil {
		var err error
		if m, err = n.findMapping(rec, dev); err != nil {
			return err
		}
	} else {
		m = n.a.recordedDevice(rec.Crypt.Mapping)
	}
	if m == nil {
		return nil
	}
	if err := n.a.crypt.Close(ctx, m.ID.DMName); err != nil {
		return fmt.Errorf("volume %q: close dm-crypt mapping %s: %w", rec.VolumeID, m.ID.DMName, err)
	}
	logFrom(ctx, n.a.log).InfoContext(ctx, "closed dm-crypt mapping", slog.String("mapping", m.ID.DMName))
	return nil
}

// resizeMapping grows the volume's mapping to its device's new size
// (cryptsetup resize; a LUKS2 volume key kept in the kernel keyring
// needs the passphrase for it) and returns the mapping.
func (n *nodeServer) resizeMapping(ctx context.Context, rec *volumeRecord, secrets map[string]string) (*devices.Device, error) {
	m := n.a.recordedDevice(rec.Crypt.Mapping)
	if m == nil {
		return nil, errdefs.FailedPrecondition("volume %q: its dm-crypt mapping %s is gone or changed since stage; unstage and stage again", rec.VolumeID, rec.Crypt.Name)
	}
	var passphrase []byte
	if p := secrets[SecretEncryptionPassphrase]; p != "" {
		passphrase = []byte(p)
	}
	if err := n.a.crypt.Resize(ctx, m.ID.DMName, passphrase); err != nil {
		if passphrase == nil {
			return nil, fmt.Errorf("volume %q: resize dm-crypt mapping %s: %w (cryptsetup needs the passphrase for it: give it in node_expand_secrets %q, the StorageClass's csi.storage.k8s.io/node-expand-secret-name)",
				rec.VolumeID, m.ID.DMName, errors.Join(err, errdefs.ErrFailedPrecondition), SecretEncryptionPassphrase)
		}
		if errors.Is(err, errdefs.ErrPermissionDenied) {
			return nil, fmt.Errorf("volume %q: resize dm-crypt mapping %s: the passphrase in secrets[%q] opens no key slot: %w", rec.VolumeID, m.ID.DMName, SecretEncryptionPassphrase, err)
		}
		return nil, fmt.Errorf("volume %q: resize dm-crypt mapping %s: %w", rec.VolumeID, m.ID.DMName, err)
	}
	// The mapping's size changed: its record follows.
	grown, err := n.a.lookup(m.Name)
	if err != nil || grown.Major != m.Major || grown.Minor != m.Minor {
		return nil, fmt.Errorf("volume %q: dm-crypt mapping %s went away during its resize", rec.VolumeID, m.ID.DMName)
	}
	rec.Crypt.Mapping.Size = grown.Size
	return grown, nil
}
