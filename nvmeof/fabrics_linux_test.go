package nvmeof

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/internal/errdefs"
	"github.com/berth-csi/berth/internal/nvmefabrics"
)

// TestConnectErrorAuth: the errnos of a failed in-band authentication
// get the codes the CO acts on; a refused connection stays Unavailable
// (Attach tells a refused key apart by probing the port).
func TestConnectErrorAuth(t *testing.T) {
	for _, tc := range []struct {
		errno unix.Errno
		want  error
		say   string
	}{
		{unix.EKEYREJECTED, errdefs.ErrPermissionDenied, "authentication failed"},
		{unix.ENOKEY, errdefs.ErrPermissionDenied, SecretDHCHAPKey},
		{unix.EPROTONOSUPPORT, errdefs.ErrUnsupported, "in-band authentication"},
		{unix.EIO, errdefs.ErrFailedPrecondition, "DH-HMAC-CHAP"},
		// 6.12 answers EIO after its admin timeout now and then when
		// the target dropped the connection over a rejected key.
		{unix.EIO, errdefs.ErrFailedPrecondition, "rejected key"},
		{unix.ECONNREFUSED, errdefs.ErrUnavailable, "refused"},
	} {
		err := connectError(&nvmefabrics.ConnectError{Err: fmt.Errorf("write /dev/nvme-fabrics: %w", tc.errno)})
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.say) {
			t.Errorf("%v: %v, want %v saying %q", tc.errno, err, tc.want, tc.say)
		}
		if tc.errno == unix.ECONNREFUSED && !errors.Is(err, errRefused) {
			t.Errorf("%v: %v does not wrap errRefused", tc.errno, err)
		}
	}
}
