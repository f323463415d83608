// Command summary prints what make e2e's runs of the Kubernetes storage
// suite did, from ginkgo's JSON reports: passed, failed and skipped specs
// per test pattern and test suite, each failure, and every skip reason with
// its count. Specs the run did not select (focus, skip) are not counted.
// It exits 1 when a spec failed or when no spec ran.
//
//	summary report.json [report.json...]
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"
)

// The parts of ginkgo's types.Report that are read.
type report struct {
	SpecReports []spec
}

type spec struct {
	ContainerHierarchyTexts []string
	LeafNodeText            string
	LeafNodeType            string
	State                   string
	RunTime                 time.Duration
	Failure                 struct {
		Message string
	}
}

var patternRE = regexp.MustCompile(`\[Testpattern: ([^\]]+)\]`)

type counts struct{ passed, failed, skipped int }

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: summary report.json...")
		os.Exit(2)
	}
	var specs []spec
	for _, f := range os.Args[1:] {
		b, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		var rs []report
		if err := json.Unmarshal(b, &rs); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", f, err)
			os.Exit(2)
		}
		for _, r := range rs {
			specs = append(specs, r.SpecReports...)
		}
	}
	os.Exit(summarize(os.Stdout, specs))
}

func summarize(w *os.File, specs []spec) int {
	per := map[string]*counts{}
	reasons := map[string]int{}
	var failures []string
	var total counts
	var took time.Duration
	for _, s := range specs {
		if s.LeafNodeType != "" && s.LeafNodeType != "It" {
			if s.State == "failed" || s.State == "panicked" || s.State == "timedout" {
				failures = append(failures, fmt.Sprintf("%s: %s", s.LeafNodeType, firstLine(s.Failure.Message)))
				total.failed++
			}
			continue
		}
		text := strings.Join(append(append([]string{}, s.ContainerHierarchyTexts...), s.LeafNodeText), " ")
		if s.State == "skipped" && s.Failure.Message == "" {
			continue // not selected by this run
		}
		pattern := "(no pattern)"
		if m := patternRE.FindStringSubmatch(text); m != nil {
			pattern = m[1]
		}
		// The suite's name follows the pattern, in the same container
		// text ("[Testpattern: Dynamic PV (xfs)] volumes") or the next.
		suite := ""
		for i, c := range s.ContainerHierarchyTexts {
			if j := strings.Index(c, "[Testpattern:"); j >= 0 {
				_, rest, _ := strings.Cut(c[j:], "]")
				suite = strings.TrimSpace(rest)
				if suite == "" && i+1 < len(s.ContainerHierarchyTexts) {
					suite = s.ContainerHierarchyTexts[i+1]
				}
			}
		}
		key := pattern + "\t" + suite
		c := per[key]
		if c == nil {
			c = &counts{}
			per[key] = c
		}
		took += s.RunTime
		switch s.State {
		case "passed":
			c.passed++
			total.passed++
		case "skipped":
			c.skipped++
			total.skipped++
			reasons[firstLine(s.Failure.Message)]++
		default:
			c.failed++
			total.failed++
			failures = append(failures, fmt.Sprintf("%s [%s]: %s", text, s.State, firstLine(s.Failure.Message)))
		}
	}
	keys := make([]string, 0, len(per))
	for k := range per {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fmt.Fprintf(w, "%-42s %-28s %6s %6s %7s\n", "pattern", "suite", "passed", "failed", "skipped")
	for _, k := range keys {
		p, s, _ := strings.Cut(k, "\t")
		c := per[k]
		fmt.Fprintf(w, "%-42s %-28s %6d %6d %7d\n", p, s, c.passed, c.failed, c.skipped)
	}
	if len(reasons) > 0 {
		fmt.Fprintln(w, "\nskipped, by reason:")
		rs := make([]string, 0, len(reasons))
		for r := range reasons {
			rs = append(rs, r)
		}
		sort.Slice(rs, func(i, j int) bool {
			return reasons[rs[i]] > reasons[rs[j]] || reasons[rs[i]] == reasons[rs[j]] && rs[i] < rs[j]
		})
		for _, r := range rs {
			fmt.Fprintf(w, "%5d  %s\n", reasons[r], r)
		}
	}
	if len(failures) > 0 {
		fmt.Fprintln(w, "\nfailed:")
		for _, f := range failures {
			fmt.Fprintln(w, "  "+f)
		}
	}
	fmt.Fprintf(w, "\nspec time %s\n", took.Round(time.Second))
	fmt.Fprintf(w, "e2e: %d passed, %d failed, %d skipped\n", total.passed, total.failed, total.skipped)
	if total.failed > 0 || total.passed == 0 {
		return 1
	}
	return 0
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 160 {
		s = s[:160] + "..."
	}
	return s
}
