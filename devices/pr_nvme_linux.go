package devices

import (
	"fmt"
	"os"

	"github.com/berth-csi/berth/internal/errdefs"
)

// readReservationNVMe reads an NVMe namespace's Reservation Report.
func readReservationNVMe(f *os.File) (Reservation, error) {
	return Reservation{}, fmt.Errorf("the NVMe Reservation Report of %s: %w", f.Name(), errdefs.ErrUnsupported)
}
