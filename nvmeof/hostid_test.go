package nvmeof

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func writeID(t *testing.T, dir, name, v string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644); err != nil {
		t.Fatal(err)
	}
}

func readID(t *testing.T, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("%s has mode %v, want 0644", name, fi.Mode().Perm())
	}
	if !strings.HasSuffix(string(b), "\n") {
		t.Errorf("%s = %q lacks a trailing newline", name, b)
	}
	return strings.TrimSpace(string(b))
}

func TestHostIdentityGenerated(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "etc", "nvme") // created on demand
	id, err := LoadHostIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !uuidRE.MatchString(id.ID) || id.ID != strings.ToLower(id.ID) {
		t.Errorf("hostid %q is not a lower-case UUID", id.ID)
	}
	if id.ID[14] != '4' || !strings.ContainsRune("89ab", rune(id.ID[19])) {
		t.Errorf("hostid %q is not a version 4 UUID", id.ID)
	}
	if id.NQN != uuidNQNPrefix+id.ID {
		t.Errorf("hostnqn %q does not carry hostid %q", id.NQN, id.ID)
	}
	if got := readID(t, dir, "hostnqn"); got != id.NQN {
		t.Errorf("persisted hostnqn %q, want %q", got, id.NQN)
	}
	if got := readID(t, dir, "hostid"); got != id.ID {
		t.Errorf("persisted hostid %q, want %q", got, id.ID)
	}
	again, err := LoadHostIdentity(dir)
	if err != nil || again != id {
		t.Errorf("second load %+v, %v; want %+v", again, err, id)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Errorf("left %d files in %s, want 2", len(ents), dir)
	}
	other, err := LoadHostIdentity(t.TempDir())
	if err != nil || other.ID == id.ID {
		t.Errorf("two hosts got the same hostid: %v %v", other, err)
	}
}

func TestHostIdentityExisting(t *testing.T) {
	const u = "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c"
	t.Run("both", func(t *testing.T) {
		dir := t.TempDir()
		// nvme-cli's older files: unrelated hostid; both kept as they are.
		writeID(t, dir, "hostnqn", "nqn.2014-08.org.nvmexpress:uuid:"+u+"\n")
		writeID(t, dir, "hostid", "0F8FAD5B-D9CB-469F-A165-70867728950E\n")
		id, err := LoadHostIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		if id.NQN != uuidNQNPrefix+u || id.ID != hidA {
			t.Errorf("got %+v", id)
		}
	})
	t.Run("hostid derived from uuid hostnqn", func(t *testing.T) {
		dir := t.TempDir()
		writeID(t, dir, "hostnqn", "nqn.2014-08.org.nvmexpress:uuid:"+strings.ToUpper(u)+"\n")
		id, err := LoadHostIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		if id.ID != u || readID(t, dir, "hostid") != u {
			t.Errorf("hostid %q, want %q", id.ID, u)
		}
	})
	t.Run("hostid generated for named hostnqn", func(t *testing.T) {
		dir := t.TempDir()
		writeID(t, dir, "hostnqn", "nqn.2026-01.io.example:node7")
		id, err := LoadHostIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		if id.NQN != "nqn.2026-01.io.example:node7" || !uuidRE.MatchString(id.ID) || readID(t, dir, "hostid") != id.ID {
			t.Errorf("got %+v", id)
		}
	})
	t.Run("hostnqn from hostid", func(t *testing.T) {
		dir := t.TempDir()
		writeID(t, dir, "hostid", u)
		id, err := LoadHostIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		if id.ID != u || id.NQN != uuidNQNPrefix+u || readID(t, dir, "hostnqn") != id.NQN {
			t.Errorf("got %+v", id)
		}
	})
	t.Run("empty files count as missing", func(t *testing.T) {
		dir := t.TempDir()
		writeID(t, dir, "hostnqn", "\n")
		writeID(t, dir, "hostid", "")
		id, err := LoadHostIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		if readID(t, dir, "hostid") != id.ID || readID(t, dir, "hostnqn") != uuidNQNPrefix+id.ID {
			t.Errorf("empty files not replaced: %+v", id)
		}
	})
	for name, files := range map[string][2]string{
		"bad hostnqn":   {"host-1", ""},
		"comma hostnqn": {"nqn.2026-01.io.example:a,b", ""},
		"bad hostid":    {"", "12345"},
		"bad uuid nqn":  {"nqn.2014-08.org.nvmexpress:uuid:zz", u},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if files[0] != "" {
				writeID(t, dir, "hostnqn", files[0])
			}
			if files[1] != "" {
				writeID(t, dir, "hostid", files[1])
			}
			_, err := LoadHostIdentity(dir)
			if !errors.Is(err, errdefs.ErrFailedPrecondition) {
				t.Fatalf("got %v, want ErrFailedPrecondition", err)
			}
			if errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("%v also wraps ErrInvalidArgument", err)
			}
			// Nothing was written over the operator's file.
			ents, _ := os.ReadDir(dir)
			n := 0
			for _, f := range files {
				if f != "" {
					n++
				}
			}
			if len(ents) != n {
				t.Errorf("%d files after the error, want %d", len(ents), n)
			}
		})
	}
}

func TestWriteIdentityFileRace(t *testing.T) {
	dir := t.TempDir()
	// Another tool wrote the file after berth found it missing: its
	// content wins and is not replaced.
	writeID(t, dir, "hostid", hidA+"\n")
	got, err := writeIdentityFile(dir, "hostid", "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c")
	if err != nil || got != hidA {
		t.Errorf("got %q, %v; want %q", got, err, hidA)
	}
	if readID(t, dir, "hostid") != hidA {
		t.Error("file replaced")
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("temporary file left behind: %d entries", len(ents))
	}
}

func TestCheckHostConflict(t *testing.T) {
	cs, err := sysTree{root: sampleSys(t).Root()}.readControllers("")
	if err != nil {
		t.Fatal(err)
	}
	if err := checkHostConflict(cs, HostIdentity{NQN: hostA, ID: hidA}); err != nil {
		t.Errorf("same identity: %v", err)
	}
	if err := checkHostConflict(cs, HostIdentity{NQN: "nqn.2026-01.io.example:other", ID: "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c"}); err != nil {
		t.Errorf("unrelated identity: %v", err)
	}
	err = checkHostConflict(cs, HostIdentity{NQN: hostA, ID: "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c"})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "nvme1") {
		t.Errorf("hostnqn with another hostid: %v", err)
	}
	err = checkHostConflict(cs, HostIdentity{NQN: "nqn.2026-01.io.example:other", ID: strings.ToUpper(hidA)})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "hostid") {
		t.Errorf("hostid with another hostnqn: %v", err)
	}
}
