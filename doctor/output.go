package doctor

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// WriteTable writes the report as an aligned table of checks, then the
// fix for each check that is not ok, then a verdict line.
func (r Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tSTATUS\tDETAIL")
	for _, c := range r.Checks {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Name, strings.ToUpper(string(c.Status)), oneLine(c.Detail))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	first := true
	for _, c := range r.Checks {
		if c.Status == OK || c.Fix == "" {
			continue
		}
		if first {
			fmt.Fprintln(w, "\nTo fix:")
			first = false
		}
		fmt.Fprintf(w, "  %s (%s): %s\n", c.Name, c.Status, oneLine(c.Fix))
	}
	var err error
	if n := len(r.Failed()); n > 0 {
		_, err = fmt.Fprintf(w, "\nnode is NOT ready for berth (%s): %d check(s) failed\n", strings.Join(r.Transports, ","), n)
	} else {
		_, err = fmt.Fprintf(w, "\nnode is ready for berth (%s)\n", strings.Join(r.Transports, ","))
	}
	return err
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// WriteJSON writes the report as one JSON object with a "ready" field.
func (r Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Ready bool `json:"ready"`
		Report
	}{r.Ready(), r})
}
