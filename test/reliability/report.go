// Package reliability holds berth's reliability suites and their report.
// Its tests crash berth at every step of a volume's life (make
// reliability); the fault tests of other packages (a target outage, a
// silent portal, a shut-down filesystem) report a row each of the fault
// table through a Fault. make reliability prints both tables.
package reliability

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// TableEnv names the file make reliability collects the crash table in;
// the fault table goes to the same name with faultSuffix added, the
// accounts of failed runs and scenarios with failureSuffix.
const TableEnv = "BERTH_RELIABILITY_TABLE"

const (
	faultSuffix   = ".faults"
	failureSuffix = ".failures"
)

// Markers start a line of a guest's output that the host half collects:
// a crash table row, a fault table row, the account of a failed run
// (quoted, one line).
const (
	rowMarker      = "BERTH-RELIABILITY-ROW "
	faultRowMarker = "BERTH-RELIABILITY-FAULT-ROW "
	failureMarker  = "BERTH-RELIABILITY-FAILURE "
)

// markedLines returns what follows marker on each line of out that has
// it (a guest's output: the marker may come after console framing).
func markedLines(out, marker string) []string {
	var lines []string
	for _, line := range strings.Split(out, "\n") {
		if i := strings.Index(line, marker); i >= 0 {
			lines = append(lines, strings.TrimSpace(line[i+len(marker):]))
		}
	}
	return lines
}

// guestFailures returns the accounts of failed runs in a guest's output.
func guestFailures(out string) []string {
	var failures []string
	for _, q := range markedLines(out, failureMarker) {
		f, err := strconv.Unquote(q)
		if err != nil {
			f = q
		}
		failures = append(failures, f)
	}
	return failures
}

// printGuestReport prints rows behind marker and the failures behind
// failureMarker, for the host half to collect from the guest's output.
func printGuestReport(marker string, rows, failures []string) {
	for _, r := range rows {
		fmt.Printf("%s%s\n", marker, r)
	}
	for _, f := range failures {
		fmt.Printf("%s%s\n", failureMarker, strconv.Quote(f))
	}
}

// appendReport appends rows to the table file named by TableEnv with
// suffix added, writing header first into a new file, and failures to
// the failures file. Without TableEnv it writes nothing.
func appendReport(suffix, header string, rows, failures []string) error {
	p := os.Getenv(TableEnv)
	if p == "" {
		return nil
	}
	if err := appendLines(p+suffix, header, rows); err != nil {
		return err
	}
	if len(failures) == 0 {
		return nil
	}
	lines := make([]string, len(failures))
	for i, f := range failures {
		lines[i] = "FAILED " + f
	}
	return appendLines(p+failureSuffix, "", lines)
}

// appendLines appends lines to the file p, after header when the file
// is new and header is not empty.
func appendLines(p, header string, lines []string) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	var b strings.Builder
	if st, err := f.Stat(); err == nil && st.Size() == 0 && header != "" {
		b.WriteString(header + "\n")
	}
	for _, l := range lines {
		b.WriteString(l + "\n")
	}
	_, err = f.WriteString(b.String())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
