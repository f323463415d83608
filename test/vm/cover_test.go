package vm

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCoverFilesRoundTrip: coverage files sent as init.sh sends them
// (base64 wrapped at 76 columns, a marker line each) come back whole.
func TestCoverFilesRoundTrip(t *testing.T) {
	want := map[string][]byte{
		"covmeta.0123abcd":           make([]byte, 10000),
		"covcounters.0123abcd.7.123": make([]byte, 77),
		"covcounters.0123abcd.8.124": {},
	}
	for _, b := range want {
		rand.Read(b)
	}
	var stream bytes.Buffer
	for name, b := range want {
		enc := base64.StdEncoding.EncodeToString(b)
		for len(enc) > 0 {
			n := min(76, len(enc))
			stream.WriteString(coverMarker + name + " " + enc[:n] + "\n")
			enc = enc[n:]
		}
	}
	c := coverFiles{}
	for _, l := range bytes.SplitAfter(stream.Bytes(), []byte("\n")) {
		if rest, ok := bytes.CutPrefix(l, []byte(coverMarker)); ok {
			if err := c.add(string(rest)); err != nil {
				t.Fatal(err)
			}
		}
	}
	dir := t.TempDir()
	if err := c.write(dir); err != nil {
		t.Fatal(err)
	}
	for name, b := range want {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if len(b) == 0 && os.IsNotExist(err) {
			continue // an empty file sends no line
		}
		if err != nil || !bytes.Equal(got, b) {
			t.Errorf("%s: %d bytes, %v; want %d bytes", name, len(got), err, len(b))
		}
	}
	for _, bad := range []string{"../covmeta.x AAAA", "covmeta.x", "notcov AAAA", "sub/covmeta AAAA"} {
		if err := (coverFiles{}).add(bad); err == nil {
			t.Errorf("add(%q) accepted", bad)
		}
	}
	if err := (coverFiles{"covmeta.x": new(strings.Builder)}).write(t.TempDir()); err != nil {
		t.Errorf("empty file: %v", err)
	}
}
