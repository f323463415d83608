package sanity

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	. "github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The suite runs csi-sanity twice, once per access type, each under a
// container named after it.
var (
	mountConfig, blockConfig sanity.TestConfig
	contexts                 []*sanity.TestContext

	reportsMu sync.Mutex
	reports   []SpecReport
)

var _ = Describe("mount", func() { contexts = append(contexts, sanity.GinkgoTest(&mountConfig)) })
var _ = Describe("block", func() { contexts = append(contexts, sanity.GinkgoTest(&blockConfig)) })

var _ = ReportAfterEach(func(r SpecReport) {
	reportsMu.Lock()
	defer reportsMu.Unlock()
	reports = append(reports, r)
})

// requiredSpecs must run and pass for each access type: they are the
// node lifecycle (stage, publish, stats, unpublish, unstage), once and
// repeated. A setup that makes sanity skip them must fail this test.
var requiredSpecs = []string{"should work", "should be idempotent"}

func TestSanity(t *testing.T) {
	bin := os.Getenv("BERTH_BIN")
	switch {
	case bin == "" || os.Geteuid() != 0:
		why := "needs root and BERTH_BIN (the berth binary; run `make sanity-test`)"
		if os.Getenv("BERTH_CI") == "1" {
			t.Fatal("BERTH_CI=1: " + why)
		}
		t.Skip(why)
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "images")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	sanityBerth(t, bin, dir, newFileController(root), "--file-root", root)
}

// controller is the CSI Controller (and its Identity) that creates the
// volumes sanity hands to berth.
type controller interface {
	csi.ControllerServer
	csi.IdentityServer
}

// sanityBerth starts berth (with the flags given) in dir, runs csi-sanity
// against it with ctl as the controller, stops berth and checks that it
// stopped cleanly and forgot every volume.
func sanityBerth(t *testing.T, bin, dir string, ctl controller, flags ...string) {
	t.Helper()
	berthSock := filepath.Join(dir, "berth.sock")
	berth, logs := startBerth(t, bin, berthSock, filepath.Join(dir, "state"), flags...)
	berthConn, err := grpc.NewClient("unix://"+berthSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer berthConn.Close()
	waitReady(t, berthConn, berth)

	nodeSock, ctlSock := filepath.Join(dir, "node.sock"), filepath.Join(dir, "controller.sock")
	serve(t, newProxy(berthConn), nodeSock)
	s := grpc.NewServer()
	csi.RegisterControllerServer(s, ctl)
	csi.RegisterIdentityServer(s, ctl)
	serve(t, s, ctlSock)

	passed := runSanity(t, dir, nodeSock, ctlSock)

	if err := berth.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := berth.Wait(); err != nil {
		t.Errorf("berth did not stop cleanly on SIGTERM: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "state", "volumes", "*.json")); len(left) > 0 {
		t.Errorf("berth still records %d volumes after sanity cleaned up", len(left))
	}
	if sanityCheckLogs != nil {
		sanityCheckLogs(t, logs.String())
	}
	if !passed || t.Failed() {
		t.Logf("berth log:\n%s", logs.String())
	}
}

// sanityCheckLogs, when set, looks at berth's log after a sanity run.
var sanityCheckLogs func(t *testing.T, log string)

// sanitySecretsFile is csi-sanity's secrets file (YAML, see
// sanity.CSISecrets) of the next runSanity; "" for none.
var sanitySecretsFile string

// runSanity runs the Node and Identity specs of csi-sanity for mount and
// block volumes against the node plugin on nodeSock, with the controller
// on ctlSock creating the volumes, and checks that the lifecycle specs ran
// and passed. Ginkgo runs once per process: one call per test binary.
func runSanity(t *testing.T, dir, nodeSock, ctlSock string) bool {
	t.Helper()
	for cfg, accessType := range map[*sanity.TestConfig]string{&mountConfig: "mount", &blockConfig: "block"} {
		*cfg = sanity.NewTestConfig()
		cfg.Address = "unix:" + nodeSock
		cfg.ControllerAddress = "unix:" + ctlSock
		cfg.TargetPath = filepath.Join(dir, accessType, "target")
		cfg.StagingPath = filepath.Join(dir, accessType, "staging")
		cfg.TestVolumeAccessType = accessType
		cfg.TestVolumeSize = 64 << 20
		cfg.TestVolumeExpandSize = 96 << 20
		cfg.IdempotentCount = 3
		cfg.SecretsFile = sanitySecretsFile
		if err := os.MkdirAll(filepath.Join(dir, accessType), 0o750); err != nil {
			t.Fatal(err)
		}
	}

	RegisterFailHandler(Fail)
	suiteConfig, reporterConfig := GinkgoConfiguration()
	// The Controller specs would test the test's controller, not berth.
	suiteConfig.FocusStrings = []string{"Node Service", "Identity Service"}
	reporterConfig.NoColor = true
	passed := RunSpecs(t, "berth csi-sanity", suiteConfig, reporterConfig)
	for _, sc := range contexts {
		sc.Finalize()
	}
	checkRequired(t)
	return passed
}

func checkRequired(t *testing.T) {
	t.Helper()
	reportsMu.Lock()
	defer reportsMu.Unlock()
	for _, accessType := range []string{"mount", "block"} {
		for _, leaf := range requiredSpecs {
			found := false
			for _, r := range reports {
				h := r.ContainerHierarchyTexts
				if len(h) < 2 || h[0] != accessType || h[1] != "Node Service" || r.LeafNodeText != leaf {
					continue
				}
				found = true
				if r.State != types.SpecStatePassed {
					t.Errorf("%s: Node Service %q: %s, want passed", accessType, leaf, r.State)
				}
			}
			if !found {
				t.Errorf("%s: Node Service %q did not run", accessType, leaf)
			}
		}
	}
	var ran, skipped int
	var skips []string
	for _, r := range reports {
		switch {
		case r.State == types.SpecStatePassed || r.State == types.SpecStateFailed:
			ran++
		case r.State == types.SpecStateSkipped && r.Failure.Message != "":
			// Skipped by sanity at run time (a capability berth lacks),
			// not filtered out by the focus.
			skipped++
			skips = append(skips, r.FullText()+": "+r.Failure.Message)
		}
	}
	t.Logf("csi-sanity: %d specs ran, %d skipped at run time:\n%s", ran, skipped, strings.Join(skips, "\n"))
}

// lockedBuffer collects a child's output.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startBerth starts `berth serve` on sock with the extra flags given.
func startBerth(t *testing.T, bin, sock, state string, flags ...string) (*exec.Cmd, *lockedBuffer) {
	t.Helper()
	logs := &lockedBuffer{}
	args := append([]string{"serve",
		"--endpoint", "unix://" + sock,
		"--node-id", "sanity-node",
		"--state-dir", state,
		"--max-volumes", "16",
	}, flags...)
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd, logs
}

// waitReady waits until berth answers Probe with ready=true.
func waitReady(t *testing.T, conn *grpc.ClientConn, cmd *exec.Cmd) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	id := csi.NewIdentityClient(conn)
	for {
		r, err := id.Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		if err == nil && r.GetReady().GetValue() {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("berth not ready: %v", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func serve(t *testing.T, s *grpc.Server, sock string) {
	t.Helper()
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(s.Stop)
}
