package vm

import (
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// CoverDirEnv names the host directory that collects coverage from the
// guests. When it is set, each in-guest test binary is built with -cover
// for every package of the module, writes its counters in the guest, and
// the guest sends them back; they land in that directory in the format of
// `go tool covdata`, beside those of any other guest.
const CoverDirEnv = "BERTH_VM_COVERDIR"

// coverPackages are the packages whose coverage a guest collects.
const coverPackages = "github.com/berth-csi/berth/..."

// guestCoverDir is where the in-guest test binary writes its counters.
const guestCoverDir = "/berth-vm/cover"

// coverMarker starts a line of a coverage file sent by the guest:
// "BERTH-VM-COVER <file name> <a line of the file in base64>".
const coverMarker = "BERTH-VM-COVER "

// coverDir is the host directory for guest coverage, "" for none.
func coverDir() string { return os.Getenv(CoverDirEnv) }

// coverFiles gathers the coverage files a guest sends, line by line.
type coverFiles map[string]*strings.Builder

// add takes one coverage line (without its marker).
func (c coverFiles) add(line string) error {
	name, data, ok := strings.Cut(strings.TrimSpace(line), " ")
	if !ok || !strings.HasPrefix(name, "cov") || filepath.Base(name) != name {
		return fmt.Errorf("guest coverage: malformed line %q", line)
	}
	b := c[name]
	if b == nil {
		b = new(strings.Builder)
		c[name] = b
	}
	b.WriteString(data)
	return nil
}

// write decodes every file into dir.
func (c coverFiles) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("guest coverage: %w", err)
	}
	names := make([]string, 0, len(c))
	for n := range c {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		b, err := base64.StdEncoding.DecodeString(c[n].String())
		if err != nil {
			return fmt.Errorf("guest coverage file %s: %w", n, err)
		}
		if err := os.WriteFile(filepath.Join(dir, n), b, 0o644); err != nil {
			return fmt.Errorf("guest coverage: %w", err)
		}
	}
	return nil
}
