// Package csitest serves berth's CSI node service inside a test and builds
// the pieces of CSI requests that the transports' guest tests share.
//
// A transport's test binds its transport to the agent's uevent listener and
// talks to the agent over a unix socket, as kubelet does:
//
//	l := csitest.Listener(t)
//	tr, err := iscsi.New(iscsi.Options{Listener: l, Logger: logger})
//	...
//	kind := agent.TransportKind{Name: iscsi.Name, Keys: iscsi.TransportKeys()}
//	node := csitest.StartAgent(t, logger, l, agent.TransportFunc(kind, tr.Parse))
//	node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{..., VolumeCapability: csitest.MountCap("ext4")})
package csitest

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
)

// Listener opens a uevent listener for the agent and its transports. It is
// closed when the test ends, after the agent StartAgent started on it.
func Listener(t testing.TB) *devices.Listener {
	t.Helper()
	l, err := devices.NewListener()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// StartAgent serves berth's CSI node service with the given transports on
// a unix socket in a temporary directory, as `berth serve` wires it, and
// returns a client of it. l is the listener the transports were built on.
// The client is closed and the agent stopped when the test ends.
func StartAgent(t testing.TB, logger *slog.Logger, l *devices.Listener, transports ...agent.Transport) csi.NodeClient {
	t.Helper()
	return StartAgentState(t, logger, l, filepath.Join(t.TempDir(), "state"), transports...)
}

// StartAgentState is StartAgent with the agent's state directory given,
// for a test that also runs what works on it beside serve (berth trim's
// agent.TrimVolumes).
func StartAgentState(t testing.TB, logger *slog.Logger, l *devices.Listener, stateDir string, transports ...agent.Transport) csi.NodeClient {
	t.Helper()
	return StartAgentLate(t, logger, l, stateDir, nil, transports...)
}

// Late is the Options.Staged that berth serve gives a transport built
// before the agent that serves it (nvmeof asks it which volumes still
// need a subsystem's controllers): it lists the volumes staged on the
// agent StartAgentLate bound it to, and none before.
type Late struct{ a atomic.Pointer[agent.Agent] }

// Staged lists the bound agent's staged volumes' contexts.
func (l *Late) Staged(ctx context.Context) ([]map[string]string, error) {
	if a := l.a.Load(); a != nil {
		return a.StagedContexts(ctx)
	}
	return nil, nil
}

// StartAgentLate is StartAgentState that binds late (when not nil) to the
// agent it starts.
func StartAgentLate(t testing.TB, logger *slog.Logger, l *devices.Listener, stateDir string, late *Late, transports ...agent.Transport) csi.NodeClient {
	t.Helper()
	dir := t.TempDir()
	a, err := agent.New(agent.Config{
		NodeID: "guest", StateDir: stateDir, Logger: logger,
		Listener: l, Transports: transports,
	})
	if err != nil {
		t.Fatal(err)
	}
	if late != nil {
		late.a.Store(a)
	}
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	lis, err := agent.Listen(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx, lis) }()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		cancel()
		<-done
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		cancel()
		<-done
	})
	return csi.NewNodeClient(conn)
}

// LogWriter writes each line written to it to the test log, for a slog
// handler or a child process's output.
func LogWriter(t testing.TB) io.Writer { return logWriter{t} }

type logWriter struct{ t testing.TB }

func (w logWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// MountCap is the capability of a volume mounted with filesystem fsType by
// a single node.
func MountCap(fsType string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// BlockCap is the capability of a raw block volume written by a single
// node.
func BlockCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}
