package fs

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestLUKSFormatArgs(t *testing.T) {
	got := strings.Join(LUKSOptions{}.formatArgs("/dev/loop0", 4096), " ")
	want := "luksFormat --type luks2 --batch-mode --key-file=- --cipher aes-xts-plain64 --sector-size 4096 --pbkdf argon2id -- /dev/loop0"
	if got != want {
		t.Fatalf("defaults:\n got %s\nwant %s", got, want)
	}
	got = strings.Join(LUKSOptions{PBKDFMemoryKiB: 32768, PBKDFIterations: 4}.formatArgs("/dev/x", 512), " ")
	for _, w := range []string{"--pbkdf-memory 32768", "--pbkdf-force-iterations 4", "--pbkdf-parallel 1", "--sector-size 512"} {
		if !strings.Contains(got, w) {
			t.Errorf("%s: no %s", got, w)
		}
	}
	if a := (LUKSOptions{PBKDF: "pbkdf2", PBKDFIterations: 1000}).formatArgs("/dev/x", 512); slices.Contains(a, "--pbkdf-parallel") {
		t.Errorf("pbkdf2 with a parallel cost: %v", a)
	}
}

func TestLUKSOpenArgs(t *testing.T) {
	if got, want := strings.Join(openArgs("/dev/loop0", "berth-v", false), " "), "open --type luks2 --key-file=- -- /dev/loop0 berth-v"; got != want {
		t.Errorf("without discards:\n got %s\nwant %s", got, want)
	}
	if got, want := strings.Join(openArgs("/dev/loop0", "berth-v", true), " "), "open --type luks2 --key-file=- --allow-discards -- /dev/loop0 berth-v"; got != want {
		t.Errorf("with discards:\n got %s\nwant %s", got, want)
	}
}

func TestLUKSSectorSize(t *testing.T) {
	for _, tc := range []struct {
		want, logical int
		size          int64
		got           int
		invalid       bool
	}{
		{0, 512, 64 << 20, 4096, false},
		{0, 512, 64<<20 + 512, 512, false},
		{0, 4096, 64 << 20, 4096, false},
		{512, 512, 64 << 20, 512, false},
		{512, 4096, 64 << 20, 0, true},
		{4096, 512, 64<<20 + 512, 0, true},
	} {
		got, err := luksSectorSize(tc.want, tc.logical, tc.size)
		if tc.invalid != errors.Is(err, errdefs.ErrInvalidArgument) || got != tc.got {
			t.Errorf("luksSectorSize(%d, %d, %d) = %d, %v", tc.want, tc.logical, tc.size, got, err)
		}
	}
}

func TestLUKSOptionsValidate(t *testing.T) {
	for _, o := range []LUKSOptions{{}, {Cipher: "aes-xts-plain64", SectorSize: 4096, PBKDF: "argon2id", PBKDFMemoryKiB: 32, PBKDFIterations: 4},
		{PBKDF: "pbkdf2", PBKDFIterations: 1000}} {
		if err := o.Validate(); err != nil {
			t.Errorf("%+v: %v", o, err)
		}
	}
	for _, o := range []LUKSOptions{{Cipher: "aes-cbc-plain"}, {Cipher: "aes-xts-plain64 "}, {SectorSize: 8192}, {PBKDF: "scrypt"},
		{PBKDF: "pbkdf2", PBKDFMemoryKiB: 1024}, {PBKDFMemoryKiB: 16}, {PBKDFMemoryKiB: 8 << 20}, {PBKDFIterations: 3}, {PBKDF: "pbkdf2", PBKDFIterations: 999}} {
		if err := o.Validate(); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%+v: %v, want invalid argument", o, err)
		}
	}
}
