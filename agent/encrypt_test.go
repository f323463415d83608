package agent

import (
	"strings"
	"testing"

	"github.com/berth-csi/berth/fs"
)

func TestMappingName(t *testing.T) {
	long := strings.Repeat("v", 128)
	seen := map[string]string{}
	for _, tc := range []struct{ id, want string }{
		{"pvc-0b7c2f8e", "berth-pvc-0b7c2f8e"},
		{"vol.1_a+b-c", "berth-vol.1_a+b-c"},
		{"a/b", ""},
		{"a_b", "berth-a_b"},
		{"vol with space", ""},
		{"sha256-abc", ""}, // never taken for a hashed name
		{long, ""},
		{"ünïcode", ""},
	} {
		got := mappingName(tc.id)
		if tc.want != "" && got != tc.want {
			t.Errorf("mappingName(%q) = %q, want %q", tc.id, got, tc.want)
		}
		if tc.want == "" && !strings.HasPrefix(got, "berth-sha256-") {
			t.Errorf("mappingName(%q) = %q, want a hashed name", tc.id, got)
		}
		if len(got) > 127 || strings.ContainsAny(got, "/ \x00") {
			t.Errorf("mappingName(%q) = %q: not a device-mapper name", tc.id, got)
		}
		if other, ok := seen[got]; ok {
			t.Errorf("volumes %q and %q share mapping %q", other, tc.id, got)
		}
		seen[got] = tc.id
	}
}

func TestParseEncryption(t *testing.T) {
	for _, off := range []map[string]string{{}, {"encrypted": "false"}, {"file": "x"}} {
		if o, err := parseEncryption(off); o != nil || err != nil {
			t.Errorf("parseEncryption(%v) = %v, %v; want not encrypted", off, o, err)
		}
	}
	o, err := parseEncryption(map[string]string{"encrypted": "true"})
	if err != nil || *o != (fs.LUKSOptions{}) {
		t.Fatalf("defaults: %+v, %v", o, err)
	}
	o, err = parseEncryption(map[string]string{"encrypted": "true", "encryptionCipher": "serpent-xts-plain64",
		"encryptionSectorSize": "512", "encryptionPBKDF": "argon2i", "encryptionPBKDFMemory": "65536", "encryptionPBKDFIterations": "5"})
	want := fs.LUKSOptions{Cipher: "serpent-xts-plain64", SectorSize: 512, PBKDF: "argon2i", PBKDFMemoryKiB: 65536, PBKDFIterations: 5}
	if err != nil || *o != want {
		t.Fatalf("all options: %+v, %v; want %+v", o, err, want)
	}
	o, err = parseEncryption(map[string]string{"encrypted": "true", "encryptionAllowDiscards": "true"})
	if err != nil || !o.AllowDiscards {
		t.Fatalf("allow discards: %+v, %v", o, err)
	}
	if o, err := parseEncryption(map[string]string{"encrypted": "true", "encryptionAllowDiscards": "false"}); err != nil || o.AllowDiscards {
		t.Fatalf("discards not allowed: %+v, %v", o, err)
	}
	for _, bad := range []string{"yes", "True", "1", ""} {
		if _, err := parseEncryption(map[string]string{"encrypted": "true", "encryptionAllowDiscards": bad}); err == nil {
			t.Errorf("encryptionAllowDiscards %q accepted", bad)
		}
	}
	if _, err := parseEncryption(map[string]string{"encryptionAllowDiscards": "true"}); err == nil {
		t.Error("encryptionAllowDiscards accepted without encrypted")
	}
	for _, bad := range []string{"+4096", "04096", "-1", "0", "4096 ", "99999999999"} {
		if _, err := parseEncryption(map[string]string{"encrypted": "true", "encryptionSectorSize": bad}); err == nil {
			t.Errorf("sector size %q accepted", bad)
		}
	}
}

func TestPassphraseOf(t *testing.T) {
	if _, err := passphraseOf(nil); err == nil {
		t.Fatal("no secrets accepted")
	}
	p, err := passphraseOf(map[string]string{SecretEncryptionPassphrase: "pass phrase\n"})
	if err != nil || string(p) != "pass phrase\n" {
		t.Fatalf("passphrase %q, %v: want the secret's bytes as they are", p, err)
	}
}
