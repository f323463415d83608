package devices

import (
	"fmt"
	"os"

	"github.com/berth-csi/berth/internal/errdefs"
)

// nvmeReservationReport says whether readReservationNVMe reads the
// Reservation Report. Until it does, ReservationReadable is false for
// NVMe devices and the agent stages them unfenced, saying so.
const nvmeReservationReport = false

// readReservationNVMe reads an NVMe namespace's Reservation Report.
func readReservationNVMe(f *os.File) (Reservation, error) {
	return Reservation{}, fmt.Errorf("the NVMe Reservation Report of %s: %w", f.Name(), errdefs.ErrUnsupported)
}
