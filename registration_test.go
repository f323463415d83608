package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/berth-csi/berth/internal/testutil"
)

// berth serve --kubelet-registration registers itself with the kubelet
// the way node-driver-registrar would: the kubelet's plugin watcher finds
// <kubelet-dir>/plugins_registry/<driver>-reg.sock, asks it GetInfo and
// then dials the endpoint it names. Stopping berth removes the socket.
func TestServeKubeletRegistration(t *testing.T) {
	testutil.RequireRoot(t, "berth serve")
	dir := t.TempDir()
	kubeletDir := filepath.Join(dir, "kubelet")
	sock := filepath.Join(kubeletDir, "plugins", "reg.csi.io", "csi.sock")
	reg := filepath.Join(kubeletDir, "plugins_registry", "reg.csi.io-reg.sock")
	p := serveBerth(t, berthArgs(sock, filepath.Join(dir, "state"), "r",
		"--driver-name=reg.csi.io", "--kubelet-registration", "--kubelet-dir="+kubeletDir)...)
	mustServe(t, p, sock, "r")

	conn, err := grpc.NewClient("unix://"+reg, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetInfo on %s: %v\n%s", reg, err, p.out)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != "reg.csi.io" || info.Endpoint != sock ||
		!slices.Equal(info.SupportedVersions, []string{"1.0.0"}) {
		t.Errorf("GetInfo = %v; want a CSIPlugin named reg.csi.io at %s, version 1.0.0", info, sock)
	}
	if _, err := registerapi.NewRegistrationClient(conn).NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	p.stop(t)
	if _, err := os.Lstat(reg); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("registration socket after berth stopped: %v (want it removed)", err)
	}
}
