package agent

import (
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestWithoutSecrets(t *testing.T) {
	got := withoutSecrets(map[string]string{"file": "a", "password": "p", "copy": "s3cret"}, map[string]string{"password": "x", "chap": "s3cret"})
	if len(got) != 1 || got["file"] != "a" {
		t.Fatalf("withoutSecrets: %v", got)
	}
}

// A missing staging path is reported by its own name, with the hint that
// the CO creates it, also when its parent is missing too.
func TestStageMissingStagingPath(t *testing.T) {
	a, _, _ := newFakeAgent(t)
	n := &nodeServer{a: a}
	dir := t.TempDir()
	for _, p := range []string{filepath.Join(dir, "vol1"), filepath.Join(dir, "stage", "vol1")} {
		_, err := n.NodeStageVolume(context.Background(), stageReq("vol1", p, "7"))
		if status.Code(err) != codes.NotFound {
			t.Fatalf("stage at missing %q: %v, want NotFound", p, err)
		}
		msg := status.Convert(err).Message()
		if !strings.Contains(msg, strconv.Quote(p)+": does not exist") || !strings.Contains(msg, "the CO creates it") || strings.Contains(msg, "parent") {
			t.Errorf("stage at missing %q: %q, want the path named as missing and the CO as its creator", p, msg)
		}
	}
}
