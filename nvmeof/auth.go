package nvmeof

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"time"

	"github.com/berth-csi/berth/internal/errdefs"
)

// ctrlAuth is what sysfs tells about the DH-HMAC-CHAP keys a fabrics
// controller was connected with. The kernel shows them (root only) in
// /sys/class/nvme/nvmeN/dhchap_secret and dhchap_ctrl_secret, "none"
// for no key (measured on 6.12: the key exactly as the connect string
// gave it, DHHC-1 form with its trailing colon); a kernel built without
// in-band authentication (Debian 12's 6.1) has neither attribute. The keys are only compared, never kept, printed or logged.
type ctrlAuth struct {
	supported  bool   // the attributes exist
	host, ctrl string // "" = no key
}

func (c ctrlAuth) describe() string {
	switch {
	case !c.supported:
		return "no DH-HMAC-CHAP key (the kernel has no in-band authentication)"
	case c.host == "":
		return "no DH-HMAC-CHAP key"
	case c.ctrl == "":
		return "a DH-HMAC-CHAP host key"
	}
	return "DH-HMAC-CHAP host and controller keys"
}

// readCtrlAuth reads a controller's key attributes.
func (s sysTree) readCtrlAuth(name string) (ctrlAuth, error) {
	dir := s.root.Path("class", "nvme", name)
	host, err := s.readAttr(dir, "dhchap_secret")
	if errors.Is(err, fs.ErrNotExist) {
		return ctrlAuth{}, nil
	}
	if err != nil {
		return ctrlAuth{}, fmt.Errorf("read controller %s: DH-HMAC-CHAP key: %w", name, unwrapPath(err))
	}
	ctrl, err := s.readAttr(dir, "dhchap_ctrl_secret")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return ctrlAuth{}, fmt.Errorf("read controller %s: DH-HMAC-CHAP controller key: %w", name, unwrapPath(err))
	}
	c := ctrlAuth{supported: true, host: host, ctrl: ctrl}
	if c.host == "none" {
		c.host = ""
	}
	if c.ctrl == "none" {
		c.ctrl = ""
	}
	return c, nil
}

// unwrapPath drops the path of a *fs.PathError (the path names the
// attribute, the message never holds its content anyway).
func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// matches reports whether a controller connected with c authenticates
// as a (nil: no keys).
func (a *Auth) matches(c ctrlAuth) bool {
	if a == nil || a.Host == nil {
		return c.host == "" && c.ctrl == ""
	}
	if !c.supported || !a.Host.equalText(c.host) {
		return false
	}
	if a.Ctrl == nil {
		return c.ctrl == ""
	}
	return a.Ctrl.equalText(c.ctrl)
}

// errNoKernelAuth explains a kernel without NVMe in-band authentication.
func errNoKernelAuth(ctrl string) error {
	return fmt.Errorf("the volume gives DH-HMAC-CHAP keys, but this kernel has no NVMe in-band authentication (controller %s has no dhchap_secret attribute: CONFIG_NVME_AUTH or CONFIG_NVME_HOST_AUTH is not set), so a connect would not authenticate: %w",
		ctrl, errdefs.ErrUnsupported)
}

// checkReuse refuses to reuse controller name for the volume unless it
// was connected with the volume's keys: a controller authenticated with
// one key must not serve a volume that names another, or none. berth
// does not change the keys of a connected controller (the kernel would
// re-authenticate every volume of the subsystem on it); new keys take
// effect at the next connect, once no volume of the subsystem on this
// node uses the controller.
func (tg *Target) checkReuse(name string) error {
	c, err := tg.t.sys.readCtrlAuth(name)
	if err != nil {
		return err
	}
	if tg.auth != nil && !c.supported {
		return errNoKernelAuth(name)
	}
	if tg.auth.matches(c) {
		return nil
	}
	want := tg.auth.String()
	if c.supported && c.host != "" && tg.auth != nil {
		want = "other DH-HMAC-CHAP keys"
	}
	return fmt.Errorf("controller %s of subsystem %s is connected with %s, and this volume names %s: berth does not reuse it, nor change the keys of a connected controller; stage the volume with the keys the controller was connected with, or unstage every volume of the subsystem on this node so that the next stage connects with the new keys: %w",
		name, tg.vol.NQN, c.describe(), want, errdefs.ErrFailedPrecondition)
}

// checkKernelAuth refuses a volume with keys before anything is
// connected when a fabrics controller shows that the kernel lacks
// in-band authentication.
func (tg *Target) checkKernelAuth(ctrls []Controller) error {
	if tg.auth == nil {
		return nil
	}
	for _, c := range ctrls {
		if c.Transport == "pcie" || c.Deleting() {
			continue
		}
		ca, err := tg.t.sys.readCtrlAuth(c.Name)
		if err != nil {
			continue
		}
		if !ca.supported {
			return errNoKernelAuth(c.Name)
		}
		return nil
	}
	return nil
}

// authRefusedDialTimeout bounds the TCP probe of authRefused.
const authRefusedDialTimeout = 2 * time.Second

// authRefused tells a failed authentication from a closed port after a
// connect with keys answered ECONNREFUSED (the errno of both on kernels
// before 6.7): when the target's port accepts a TCP connection now, the
// target refused the keys.
func (tg *Target) authRefused(ctx context.Context, p Path) bool {
	if tg.auth == nil || p.TrType != TransportTCP {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, authRefusedDialTimeout)
	defer cancel()
	var d net.Dialer
	if p.HostTrAddr != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(p.HostTrAddr)}
	}
	c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(p.TrAddr, p.TrSvcID))
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// errAuthRefused is the error of a connect authRefused explains.
func errAuthRefused(hostNQN string) error {
	return fmt.Errorf("connect: DH-HMAC-CHAP authentication failed (the target's port accepts connections, but the connect with keys was refused): the target rejected the host key (secret %q), or the controller did not prove the controller key (secret %q); check both against the target's keys for hostnqn %s: %w",
		SecretDHCHAPKey, SecretDHCHAPCtrlKey, hostNQN, errdefs.ErrPermissionDenied)
}
