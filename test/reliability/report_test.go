package reliability

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// A failed guest run's account crosses the console as one quoted line
// and lands, whole, in the failures file printed below the table.
func TestFailureAccountReachesTheReport(t *testing.T) {
	account := "nvmeof/block 042-nvmeof.disconnected: NodeUnstageVolume: rpc error\n\tberth log, last lines:\n\tlevel=INFO msg=\"unstaged\""
	out := "noise\n[  1.0] " + rowMarker + "| nvmeof/block | 67 | 66 | 665 | 0 | 0 | 90s |\n" +
		"console: " + failureMarker + strconv.Quote(account) + "\nmore noise\n"
	rows, failures := guestReport(out)
	if want := []string{"| nvmeof/block | 67 | 66 | 665 | 0 | 0 | 90s |"}; !slices.Equal(rows, want) {
		t.Fatalf("rows %q, want %q", rows, want)
	}
	if !slices.Equal(failures, []string{account}) {
		t.Fatalf("failures %q, want %q", failures, []string{account})
	}

	table := filepath.Join(t.TempDir(), "table.md")
	t.Setenv("BERTH_RELIABILITY_TABLE", table)
	reportTable(t, rows, failures)
	b, err := os.ReadFile(table)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), rows[0]) {
		t.Errorf("table %q lacks the row", b)
	}
	b, err = os.ReadFile(table + ".failures")
	if err != nil {
		t.Fatal(err)
	}
	if want := "FAILED " + account + "\n"; string(b) != want {
		t.Errorf("failures file %q, want %q", b, want)
	}
}
