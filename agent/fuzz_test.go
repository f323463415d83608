package agent

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// FuzzValidatePath: an accepted path is absolute, clean, printable, and
// cannot climb out of where it says it is.
func FuzzValidatePath(f *testing.F) {
	for _, s := range []string{"/a/b", "", "a", "/a/../b", "//a", "/a/", "/a\x00", "/a\nb", "/$(x)", "/\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if err := validatePath("target_path", p); err != nil {
			return
		}
		if !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/" || hasControl(p) || !utf8.ValidString(p) {
			t.Fatalf("accepted %q", p)
		}
		for _, elem := range strings.Split(p, "/") {
			if elem == ".." || elem == "." {
				t.Fatalf("accepted %q with a %q element", p, elem)
			}
		}
	})
}

// FuzzVolumeContext: volume_context parsing never panics, and an image
// it accepts is below the file root.
func FuzzVolumeContext(f *testing.F) {
	f.Add("file", "a.img", "transport", "file")
	f.Add("file", "../../etc/passwd", "", "")
	f.Add("nqn", "nqn.x", "iqn", "iqn.y")
	f.Add("file", "/etc/passwd", "transport", "file")
	f.Add("file", "a/./../../b", "x", "\x00")
	root, err := filepath.EvalSymlinks(f.TempDir())
	if err != nil {
		f.Fatal(err)
	}
	ft := fileTransport(f, root, nil)
	ts := map[string]Transport{ft.Name(): ft}
	implied, err := impliedTransports([]Transport{ft}, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		vc, err := mergeContext(map[string]string{k1: v1}, map[string]string{k2: v2})
		if err != nil {
			return
		}
		for k, v := range vc {
			if hasControl(k) || hasControl(v) {
				t.Fatalf("accepted control characters in %q=%q", k, v)
			}
		}
		tr, err := selectTransport(vc, implied, ts)
		if err != nil {
			return
		}
		tg, err := tr.Parse(vc, nil)
		if err != nil {
			return
		}
		key := tg.Key()
		if !strings.HasPrefix(key, root+"/") || filepath.Clean(key) != key {
			t.Fatalf("volume_context %v names %q, outside the root %s", vc, key, root)
		}
	})
}

// FuzzStateFileName: every volume ID maps to a plain file name.
func FuzzStateFileName(f *testing.F) {
	f.Add("../../etc")
	f.Add("/")
	f.Fuzz(func(t *testing.T, id string) {
		name := stateFileName(id)
		if strings.ContainsAny(name, "/\x00") || name == "." || name == ".." || len(name) != 69 {
			t.Fatalf("state file name %q for %q", name, id)
		}
	})
}

// FuzzNodeRequests feeds arbitrary request bytes to every Node RPC of an
// agent on fakes. No input may panic or end as Internal, and a refused
// NodeStageVolume leaves no record and no mount behind.
func FuzzNodeRequests(f *testing.F) {
	seed := func(m proto.Message) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(stageReq("vol", "/tmp/x", "1"))
	seed(&csi.NodePublishVolumeRequest{VolumeId: "vol", StagingTargetPath: "/tmp/x", TargetPath: "/tmp/y", VolumeCapability: blockCap(snw)})
	seed(&csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: "/tmp/x", CapacityRange: &csi.CapacityRange{RequiredBytes: -1}})
	f.Fuzz(func(t *testing.T, b []byte) {
		a, host, _ := newFakeAgent(t)
		a.log = slog.New(slog.NewTextHandler(io.Discard, nil))
		n := &nodeServer{a: a}
		ctx := context.Background()
		check := func(what string, err error) {
			if c := status.Code(err); c == codes.Internal || c == codes.Unknown {
				t.Fatalf("%s: %v", what, err)
			}
		}
		var stage csi.NodeStageVolumeRequest
		if proto.Unmarshal(b, &stage) == nil {
			_, err := n.NodeStageVolume(ctx, &stage)
			check("stage", err)
			if err != nil && (a.state.count() != 0 || len(host.mounts) != 0) {
				t.Fatalf("refused stage (%v) left %d records, %d mounts", err, a.state.count(), len(host.mounts))
			}
		}
		var pub csi.NodePublishVolumeRequest
		if proto.Unmarshal(b, &pub) == nil {
			_, err := n.NodePublishVolume(ctx, &pub)
			check("publish", err)
		}
		var unpub csi.NodeUnpublishVolumeRequest
		if proto.Unmarshal(b, &unpub) == nil {
			_, err := n.NodeUnpublishVolume(ctx, &unpub)
			check("unpublish", err)
		}
		var unstage csi.NodeUnstageVolumeRequest
		if proto.Unmarshal(b, &unstage) == nil {
			_, err := n.NodeUnstageVolume(ctx, &unstage)
			check("unstage", err)
		}
		var stats csi.NodeGetVolumeStatsRequest
		if proto.Unmarshal(b, &stats) == nil {
			_, err := n.NodeGetVolumeStats(ctx, &stats)
			check("stats", err)
		}
		var exp csi.NodeExpandVolumeRequest
		if proto.Unmarshal(b, &exp) == nil {
			_, err := n.NodeExpandVolume(ctx, &exp)
			check("expand", err)
		}
	})
}
