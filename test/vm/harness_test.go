package vm

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// readNewc parses a newc archive into name -> (mode, content).
func readNewc(t *testing.T, b []byte) map[string]struct {
	mode uint32
	data string
} {
	t.Helper()
	out := map[string]struct {
		mode uint32
		data string
	}{}
	align := func(n int) int { return (n + 3) &^ 3 }
	for off := 0; ; {
		if len(b)-off < 110 || string(b[off:off+6]) != "070701" {
			t.Fatalf("bad header at %d", off)
		}
		field := func(i int) int {
			v, err := strconv.ParseUint(string(b[off+6+8*i:off+14+8*i]), 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return int(v)
		}
		mode, size, nameLen := field(1), field(6), field(11)
		name := string(b[off+110 : off+110+nameLen-1])
		off = align(off + 110 + nameLen)
		if name == "TRAILER!!!" {
			return out
		}
		out[name] = struct {
			mode uint32
			data string
		}{uint32(mode), string(b[off : off+size])}
		off = align(off + size)
	}
}

func TestCPIOWriter(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "tree", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tree", "sub", "f"), []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("sub/f", filepath.Join(dir, "tree", "l")); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	c := newCPIOWriter(&buf)
	c.Bytes("init", 0o755, []byte("#!/bin/sh\n"))
	c.File("a/b", filepath.Join(dir, "tree"))
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	got := readNewc(t, buf.Bytes())
	for name, want := range map[string]struct {
		mode uint32
		data string
	}{
		"init":      {0o100755, "#!/bin/sh\n"},
		"a":         {0o40755, ""},
		"a/b":       {0o40755, ""},
		"a/b/sub":   {0o40755, ""},
		"a/b/sub/f": {0o100600, "hello"},
		"a/b/l":     {0o120777, "sub/f"},
	} {
		if g, ok := got[name]; !ok || g != want {
			t.Errorf("%s = %+v (present %v), want %+v", name, g, ok, want)
		}
	}
}

func TestCollectResults(t *testing.T) {
	events := []testEvent{
		{Action: "start"},
		{Action: "run", Test: "TestA"},
		{Action: "output", Test: "TestA", Output: "=== RUN   TestA\n"},
		{Action: "output", Test: "TestA", Output: "    a_test.go:1: hello\n"},
		{Action: "run", Test: "TestA/sub"},
		{Action: "output", Test: "TestA/sub", Output: "=== RUN   TestA/sub\n"},
		{Action: "fail", Test: "TestA/sub"},
		{Action: "output", Test: "TestA", Output: signalMarker + "ready\n"},
		{Action: "fail", Test: "TestA", Elapsed: 1.5},
		{Action: "run", Test: "TestB"},
		{Action: "skip", Test: "TestB"},
		{Action: "run", Test: "TestC"},
		{Action: "output", Test: "TestC", Output: "panic: boom\n"},
		{Action: "output", Output: "FAIL\n"},
	}
	rs := collectResults(events)
	if len(rs) != 3 {
		t.Fatalf("got %d results, want 3", len(rs))
	}
	a, b, c := rs[0], rs[1], rs[2]
	if a.name != "TestA" || a.action != "fail" || a.elapsed != 1.5 {
		t.Errorf("TestA = %+v", a)
	}
	if out := strings.Join(a.output, ""); !strings.Contains(out, "hello") || !strings.Contains(out, "=== RUN   TestA/sub") ||
		strings.Contains(out, "=== RUN   TestA\n") || strings.Contains(out, signalMarker) {
		t.Errorf("TestA output = %q", out)
	}
	if b.action != "skip" {
		t.Errorf("TestB action %q, want skip", b.action)
	}
	if c.action != "" {
		t.Errorf("TestC (never finished) action %q, want none", c.action)
	}
}

func TestConfigScriptQuoting(t *testing.T) {
	m := &Machine{name: "TestX/sub case", cfg: defaultConfig()}
	m.cfg.run = `^Test(A|B)$`
	m.cfg.env["WEIRD"] = `it's "quoted" $HOME`
	s := string(m.configScript(&image{kernelVersion: "6.1"}))
	for _, want := range []string{
		`export WEIRD='it'\''s "quoted" $HOME'`,
		`'-test.run=^Test(A|B)$'`,
		`BERTH_VM_HOSTNAME='TestX-sub-case'`,
	} {
		if !strings.Contains(s, want) {
			t.Errorf("config script lacks %s:\n%s", want, s)
		}
	}
}
