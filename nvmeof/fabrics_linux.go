package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/berth-csi/berth/internal/blockdev"
	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/nvmefabrics"
	"github.com/berth-csi/berth/internal/sysfs"
)

// DefaultFabricsDevice is the kernel's fabrics connect interface.
const DefaultFabricsDevice = "/dev/nvme-fabrics"

// errDuplicate reports that the kernel refused a connect because a
// controller with the same options already exists.
var errDuplicate = errors.New("a controller with these options already exists")

// errRefused marks a connect the target refused (nvmefabrics.Refused),
// which on kernels before 6.7 is also a failed DH-HMAC-CHAP
// authentication; the caller tells the two apart (see Target.authRefused).
var errRefused = errors.New("connection refused")

// errReset marks a connect the target reset (nvmefabrics.Reset): the
// target dropped the connection before answering the NVMe/TCP
// initialization.
var errReset = errors.New("the target reset the connection")

// errNoHandshake marks a connect with tls whose handshake upcall found no
// tlshd listening (nvmefabrics.NoHandshake).
var errNoHandshake = errors.New("no TLS handshake daemon")

// errSilent marks a connect to a path that did not answer: no SYN-ACK
// (the kernel gives up after one SYN retry, about 3 s) or no ICResp to the
// NVMe/TCP initialization (10 s), as a path behind a firewall that drops
// packets, a dead switch port or a hung target looks.
var errSilent = errors.New("the path did not answer")

// fabricsConnect writes one connect string to dev (see
// nvmefabrics.Connect) and names what the kernel's refusal means.
func fabricsConnect(ctx context.Context, dev, opts string) (instance int, err error) {
	instance, err = nvmefabrics.Connect(ctx, dev, opts)
	var ce *nvmefabrics.ConnectError
	if errors.As(err, &ce) {
		return 0, connectError(ce)
	}
	return instance, err
}

// connectError says what a refused connect means for the volume, and
// what to check.
func connectError(ce *nvmefabrics.ConnectError) error {
	errno := ce.Errno()
	switch ce.Reason() {
	case nvmefabrics.Duplicate:
		return fmt.Errorf("connect: %w (%v)", errDuplicate, errno)
	case nvmefabrics.Refused:
		return fmt.Errorf("connect: the target refused the connection (no NVMe/TCP listener at that address and port?): %w: %w", errRefused, errdefs.ErrUnavailable)
	case nvmefabrics.AuthFailed:
		return fmt.Errorf("connect: DH-HMAC-CHAP authentication failed (%v): the target rejected the host key (secret %q), or the controller did not prove the controller key (secret %q); check both against the target's keys for this hostnqn: %w",
			errno, SecretDHCHAPKey, SecretDHCHAPCtrlKey, errdefs.ErrPermissionDenied)
	case nvmefabrics.NoKey:
		return fmt.Errorf("connect: the target requires DH-HMAC-CHAP authentication and the volume gives no key (%v): set the host key in the secret %q (node stage secrets): %w",
			errno, SecretDHCHAPKey, errdefs.ErrPermissionDenied)
	case nvmefabrics.AuthUnsupported:
		return fmt.Errorf("connect: the target requires NVMe in-band authentication (DH-HMAC-CHAP), which this kernel does not support (%v; CONFIG_NVME_AUTH or CONFIG_NVME_HOST_AUTH is not set): %w",
			errno, errdefs.ErrUnsupported)
	case nvmefabrics.NoHandshake:
		return fmt.Errorf("connect: %w (%v)", errNoHandshake, errno)
	case nvmefabrics.Unreachable:
		// With tls, ETIMEDOUT is also a TLS handshake that failed
		// (see tls.go): Target.tlsConnectError tells the two apart.
		return fmt.Errorf("connect: target unreachable (%v): %w: %w", errno, errSilent, errdefs.ErrUnavailable)
	case nvmefabrics.NoInitResponse:
		return fmt.Errorf("connect: the target accepted the TCP connection but never answered the NVMe/TCP initialization (%v): check that an NVMe/TCP target, not another service, listens there and is not hung: %w: %w", errno, errSilent, errdefs.ErrUnavailable)
	case nvmefabrics.OptionsRejected:
		return fmt.Errorf("connect: the kernel rejected the connect options (%v); check dmesg: a hostnqn paired with another hostid, a transport module missing, or a target refusing this host: %w", errno, errdefs.ErrFailedPrecondition)
	case nvmefabrics.Reset:
		// Measured on 6.12: a connect without tls to an nvmet port
		// that requires TLS (addr_treq "required").
		return fmt.Errorf("connect: %w (%v): when its port requires TLS, set volume_context %q=\"true\" and give the PSK (secret %q); else check that the subsystem exists and allows this hostnqn: %w", errReset, errno, KeyTLS, SecretTLSKey, errdefs.ErrFailedPrecondition)
	case nvmefabrics.Rejected:
		// EIO is also what 6.12 answers, after its 60 s admin timeout,
		// when the target dropped the connection over a rejected key
		// while the host waited for its authentication reply (measured
		// on 6.12.117 against nvmet, about one rejection in three).
		return fmt.Errorf("connect: the target rejected the connect (%v); check that the subsystem exists and allows this hostnqn, and whether it requires DH-HMAC-CHAP authentication (secrets %q, %q); when the volume gives keys and the connect took about a minute, a rejected key is the likely cause: check the keys against the target's for this hostnqn: %w", errno, SecretDHCHAPKey, SecretDHCHAPCtrlKey, errdefs.ErrFailedPrecondition)
	case nvmefabrics.Exhausted:
		return fmt.Errorf("connect: %v: %w", errno, errdefs.ErrResourceExhausted)
	}
	return fmt.Errorf("connect: %w", ce)
}

// deleteController removes the fabrics controller called name through
// sysfs if it still is the controller is describes. Controller names are
// reused as soon as a controller is gone, so the name alone may by now
// stand for another subsystem's new controller (another volume's, another
// agent's): the controller's sysfs directory is opened once, its
// attributes are read and checked through that descriptor, and the delete
// is written through it too. A directory removed meanwhile answers ENOENT
// or ENODEV through the descriptor even when a new controller took the
// name. The write returns once the kernel has torn the controller down. A
// controller that is already gone, or whose name now stands for another
// controller, is success. nqn is the subsystem of the controller to
// delete: no address of its controllers is read in this process while
// the kernel tears the controller down (see readController).
func (s sysTree) deleteController(nqn, name string, is func(*Controller) bool) error {
	dir, err := os.Open(s.root.Path("class", "nvme", name))
	if sysfs.Gone(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete controller %s: %w", name, err)
	}
	defer dir.Close()
	at := fmt.Sprintf("/proc/self/fd/%d", dir.Fd())
	cur, err := s.readController(at, nqn)
	if sysfs.Gone(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete controller %s: %w", name, err)
	}
	cur.Name = name
	if !is(&cur) {
		return nil
	}
	f, err := os.OpenFile(filepath.Join(at, "delete_controller"), os.O_WRONLY, 0)
	if sysfs.Gone(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete controller %s: %w", name, err)
	}
	defer f.Close()
	unlock := teardown.lock(nqn)
	_, err = f.Write([]byte("1"))
	unlock()
	if err != nil && !sysfs.Gone(err) {
		return fmt.Errorf("delete controller %s: %w", name, err)
	}
	return nil
}

// rescanController asks a controller to identify its namespaces again,
// which picks up size changes the target did not announce by AEN.
func (s sysTree) rescanController(name string) error {
	p := s.root.Path("class", "nvme", name, "rescan_controller")
	if err := os.WriteFile(p, []byte("1"), 0); err != nil {
		return fmt.Errorf("rescan controller %s: %w", name, err)
	}
	return nil
}

// openedExclusively reports whether a block device is mounted, held by
// a device mapper table or otherwise opened exclusively: an O_EXCL open
// of a block device fails with EBUSY then (blockdev.Held).
func openedExclusively(path string) bool {
	held, _ := blockdev.Held(path)
	return held
}
