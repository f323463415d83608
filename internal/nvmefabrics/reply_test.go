package nvmefabrics

import (
	"os"
	"path/filepath"
	"testing"
)

func readSample(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseReply(t *testing.T) {
	i, c, err := parseReply(readSample(t, "reply"))
	if err != nil || i != 3 || c != 1 {
		t.Errorf("reply sample: %d %d %v", i, c, err)
	}
	for _, bad := range []string{"", "instance=3", "cntlid=1", "instance=x,cntlid=1", "instance=-1,cntlid=1", "garbage"} {
		if _, _, err := parseReply([]byte(bad)); err == nil {
			t.Errorf("parseReply(%q) succeeded", bad)
		}
	}
}
