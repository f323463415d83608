package iscsi_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/fs"
	"github.com/berth-csi/berth/iscsi"
	"github.com/berth-csi/berth/test/csitest"
	"github.com/berth-csi/berth/test/reliability"
	"github.com/berth-csi/berth/test/vm"
)

// rpcDeadline is the deadline of each unpublish and unstage below: the
// kubelet gives far more, but a call that waits for a dead device waits
// for any deadline.
const rpcDeadline = 10 * time.Second

// timedRPC runs one call with rpcDeadline and fails the test when it ran
// past it. The client's own deadline ends the wait in any case, so what
// the server did shows in the next call: a handler still blocked in the
// kernel holds the volume's lock.
func timedRPC(t *testing.T, what string, call func(ctx context.Context) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcDeadline)
	defer cancel()
	start := time.Now()
	err := call(ctx)
	el := time.Since(start)
	t.Logf("%s: %v in %v", what, err, el.Round(time.Millisecond))
	if el > rpcDeadline+time.Second {
		t.Fatalf("%s ran %v, past its %v deadline", what, el, rpcDeadline)
	}
	return err
}

// deviceOf looks up a block device by number.
func deviceOf(major, minor uint32) (*devices.Device, error) {
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", major, minor))
	if err != nil {
		return nil, err
	}
	return devices.Roots{}.Lookup(filepath.Base(link))
}

// isMountRoot reports whether something is mounted at p.
func isMountRoot(t *testing.T, p string) bool {
	t.Helper()
	st, err := fs.StatPath(p)
	if errors.Is(err, os.ErrNotExist) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return st.MountRoot
}

// writer writes into dir until stop closes or its budget is used: dirty
// pages in the page cache, as a pod leaves them behind.
func writer(dir string, stop <-chan struct{}) <-chan error {
	done := make(chan error, 1)
	go func() {
		f, err := os.OpenFile(filepath.Join(dir, "log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			done <- err
			return
		}
		buf := make([]byte, 64<<10)
		for i := 0; i < 128; i++ { // 8 MiB at most
			select {
			case <-stop:
				done <- f.Close()
				return
			case <-time.After(20 * time.Millisecond):
			}
			if _, err := f.Write(buf); err != nil {
				f.Close()
				done <- err
				return
			}
		}
		done <- f.Close()
	}()
	return done
}

// queueForever makes multipathd build maps that queue I/O for as long as
// no path works (no_path_retry queue), whatever its hardware table says
// of the target.
func queueForever(t *testing.T) {
	t.Helper()
	iscsi.StartMultipathd(t)
	conf := "/etc/multipath/conf.d/queue.conf"
	if err := os.MkdirAll(filepath.Dir(conf), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(conf, []byte("overrides {\n\tno_path_retry queue\n}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, "multipathd", "reconfigure")
	t.Cleanup(func() {
		os.Remove(conf)
		exec.Command("multipathd", "reconfigure").Run()
	})
}

// mapFeatures returns the feature words of a map's table.
func mapFeatures(t *testing.T, dmName string) string {
	t.Helper()
	out, err := exec.Command("dmsetup", "table", dmName).CombinedOutput()
	if err != nil {
		t.Fatalf("dmsetup table %s: %v: %s", dmName, err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestMultipathISCSIAgentUnstageDeadPaths: every path of a map that
// queues I/O while no path works is gone, with the volume staged,
// published and written to. Unpublish and unstage each return within
// their deadline, and (the paths still gone) a retry leaves nothing: no
// map, no session, no mount.
func TestMultipathISCSIAgentUnstageDeadPaths(t *testing.T) {
	vm.RequireGuest(t)
	queueForever(t)
	logger := slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))
	node := startAgent(t, logger)
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260", "127.0.0.2:3260")
	wwid := lt.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	dir := t.TempDir()
	staging := filepath.Join(dir, "staging")
	targetPath := filepath.Join(dir, "pod", "vol")
	os.MkdirAll(staging, 0o750)
	os.MkdirAll(filepath.Dir(targetPath), 0o750)
	id := "vol-deadpaths"
	vctx := map[string]string{"portals": `["127.0.0.1:3260","127.0.0.2:3260"]`, "iqn": lt.IQN, "lun": "0", "wwid": wwid,
		"multipath": "true", iscsi.ParamReplacementTimeout: "2"}
	capability := csitest.MountCap("ext4")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: capability, VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st, err := fs.StatPath(staging)
	if err != nil {
		t.Fatal(err)
	}
	dm, err := deviceOf(st.Major, st.Minor)
	if err != nil || dm.ID.Kind != devices.KindDM {
		t.Fatalf("staging mount is on %d:%d (%v, %v), not a map", st.Major, st.Minor, dm, err)
	}
	if f := mapFeatures(t, dm.ID.DMName); !strings.Contains(f, "queue_if_no_path") {
		t.Fatalf("map %s does not queue: %s", dm.ID.DMName, f)
	}
	// Fencing registered the node's key through both paths of the map
	// and holds the reservation.
	key := fmt.Sprintf("Key: %#016x", agent.NodeKey("guest"))
	if reg := lt.PR(0, "res_pr_registered_i_pts"); strings.Count(reg, key) != 2 || !strings.Contains(lt.PR(0, "res_pr_type"), "Registrants Only") {
		t.Errorf("want the node's key registered on both paths and holding Write Exclusive – Registrants Only: %s; %s", reg, lt.PR(0, "res_pr_type"))
	} else {
		t.Logf("LIO: %s", reg)
	}
	// Whatever happens below, the map stops queueing when the test
	// ends, so that nothing stays blocked in the guest.
	t.Cleanup(func() { exec.Command("dmsetup", "message", dm.ID.DMName, "0", "fail_if_no_path").Run() })
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: targetPath, VolumeCapability: capability, VolumeContext: vctx}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}

	stop := make(chan struct{})
	done := writer(targetPath, stop)
	time.Sleep(300 * time.Millisecond)
	lt.Vanish(1)
	lt.Vanish(2)
	waitFor(t, 30*time.Second, "the map to fail both paths", func() bool {
		ps, err := devices.MultipathPaths(dm)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if p.Active {
				return false
			}
		}
		return true
	})
	close(stop)
	select {
	case err := <-done:
		t.Logf("writer ended: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the writer is stuck")
	}

	if err := timedRPC(t, "NodeUnpublishVolume", func(ctx context.Context) error {
		_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetPath})
		return err
	}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	unstage := func(ctx context.Context) error {
		_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		return err
	}
	if err := timedRPC(t, "NodeUnstageVolume", unstage); err != nil {
		// A first call may end at its deadline; the retry must finish.
		if err := timedRPC(t, "NodeUnstageVolume (retry)", unstage); err != nil {
			t.Fatalf("NodeUnstageVolume retry with every path gone: %v", err)
		}
	}
	if isMountRoot(t, staging) {
		t.Errorf("%s is still mounted", staging)
	}
	if _, err := os.Stat("/sys/class/block/" + dm.Name); err == nil {
		t.Errorf("map %s (%s) still exists", dm.Name, dm.ID.DMName)
	}
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Errorf("%d sessions left", n)
	}
}

// TestGuestISCSIAgentUnstageLeakedMount: a bind of the staging mount made
// outside berth (a mount propagated into another namespace, an operator's
// bind) keeps the filesystem, and so the disk, in use after the staging
// mount is gone. Unstage refuses and names the holder, and the disk stays;
// once that mount is gone, unstage finishes.
func TestGuestISCSIAgentUnstageLeakedMount(t *testing.T) {
	vm.RequireGuest(t)
	node := startAgent(t, slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug})))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260")
	wwid := lt.AddLUN(0, 32<<20)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	dir := t.TempDir()
	staging := filepath.Join(dir, "staging")
	leak := filepath.Join(dir, "leak")
	os.MkdirAll(staging, 0o750)
	os.MkdirAll(leak, 0o750)
	id := "vol-leak"
	vctx := map[string]string{"targetPortal": lt.Portal(1), "iqn": lt.IQN, "lun": "0", "wwid": wwid}
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: csitest.MountCap("ext4"), VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st, err := fs.StatPath(staging)
	if err != nil {
		t.Fatal(err)
	}
	disk, err := deviceOf(st.Major, st.Minor)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(staging, "data"), []byte("still here"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(staging, leak, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(leak, unix.MNT_DETACH) })

	unstage := func(ctx context.Context) error {
		_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		return err
	}
	for _, what := range []string{"NodeUnstageVolume", "NodeUnstageVolume (retry)"} {
		err := timedRPC(t, what, unstage)
		if c := status.Code(err); c != codes.FailedPrecondition && c != codes.Aborted {
			t.Fatalf("%s with the filesystem mounted at %s: %v, want FailedPrecondition or Aborted", what, leak, err)
		}
		if !strings.Contains(err.Error(), leak) {
			t.Errorf("%s: the error does not name the mount at %s: %v", what, leak, err)
		}
		if _, err := os.Stat("/sys/class/block/" + disk.Name); err != nil {
			t.Fatalf("the disk %s was deleted under the mount at %s: %v", disk.Name, leak, err)
		}
		if b, err := os.ReadFile(filepath.Join(leak, "data")); err != nil || string(b) != "still here" {
			t.Fatalf("read through the leaked mount: %q, %v", b, err)
		}
	}
	if n := iscsiSessions(t, lt.IQN); n != 1 {
		t.Fatalf("%d sessions, want the volume's one", n)
	}
	if err := unix.Unmount(leak, 0); err != nil {
		t.Fatal(err)
	}
	if err := timedRPC(t, "NodeUnstageVolume (leak gone)", unstage); err != nil {
		t.Fatalf("NodeUnstageVolume after the leaked mount went: %v", err)
	}
	if _, err := os.Stat("/sys/class/block/" + disk.Name); err == nil {
		t.Errorf("disk %s still exists", disk.Name)
	}
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Errorf("%d sessions left", n)
	}
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stageMultipath stages a multipath ext4 volume of LUN 0 of lt (queueing
// while no path works) and returns its map.
func stageMultipath(t *testing.T, ctx context.Context, node csi.NodeClient, lt interface {
	Portal(int) string
}, iqn, wwid, id, staging string) (*devices.Device, map[string]string) {
	t.Helper()
	vctx := map[string]string{"portals": fmt.Sprintf(`[%q,%q]`, lt.Portal(1), lt.Portal(2)), "iqn": iqn, "lun": "0", "wwid": wwid,
		"multipath": "true", iscsi.ParamReplacementTimeout: "30"}
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: csitest.MountCap("ext4"), VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st, err := fs.StatPath(staging)
	if err != nil {
		t.Fatal(err)
	}
	dm, err := deviceOf(st.Major, st.Minor)
	if err != nil || dm.ID.Kind != devices.KindDM {
		t.Fatalf("staging mount is on %d:%d (%v, %v), not a map", st.Major, st.Minor, dm, err)
	}
	if f := mapFeatures(t, dm.ID.DMName); !strings.Contains(f, "queue_if_no_path") {
		t.Fatalf("map %s does not queue: %s", dm.ID.DMName, f)
	}
	t.Cleanup(func() { exec.Command("dmsetup", "message", dm.ID.DMName, "0", "fail_if_no_path").Run() })
	return dm, vctx
}

// TestFaultMultipathISCSIUnstageOutage: both paths of a multipath volume
// go down just before its unstage and come back 3 s into it (a switch
// failing over, a target restarting). The unstage waits for them with the
// map still queueing, so that the dirty pages written before it reach the
// LUN: staged again, the volume holds every byte.
func TestFaultMultipathISCSIUnstageOutage(t *testing.T) {
	vm.RequireGuest(t)
	queueForever(t)
	fault := reliability.StartFault(t, "iSCSI multipath: both paths down for 3 s during an unstage with dirty pages, then staged again")
	node := fault.Node(startAgent(t, slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260", "127.0.0.2:3260")
	wwid := lt.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	staging := filepath.Join(t.TempDir(), "staging")
	os.MkdirAll(staging, 0o750)
	id := "vol-blip"
	_, vctx := stageMultipath(t, ctx, node, lt, lt.IQN, wwid, id, staging)

	// Dirty pages, not yet written back: 4 MiB of a known pattern.
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i*7 + i>>12)
	}
	if err := os.WriteFile(filepath.Join(staging, "data"), want, 0o644); err != nil {
		t.Fatal(err)
	}
	lt.Vanish(1)
	lt.Vanish(2)
	uctx, ucancel := context.WithTimeout(ctx, time.Minute)
	defer ucancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := node.NodeUnstageVolume(uctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		done <- err
	}()
	time.Sleep(3 * time.Second)
	lt.Restore(1)
	lt.Restore(2)
	if err := <-done; err != nil {
		t.Fatalf("NodeUnstageVolume through a 3 s outage: %v after %v", err, time.Since(start))
	}
	t.Logf("unstage through a 3 s outage took %v", time.Since(start).Round(time.Millisecond))
	if n := iscsiSessions(t, lt.IQN); n != 0 {
		t.Errorf("%d sessions left after the unstage", n)
	}

	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: csitest.MountCap("ext4"), VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume again: %v", err)
	}
	got, err := os.ReadFile(filepath.Join(staging, "data"))
	lost := differing(got, want)
	fault.Lost(lost)
	if err != nil || lost > 0 {
		t.Errorf("staged again, the file holds %d bytes (%v), %d of the %d written differ", len(got), err, lost, len(want))
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	fault.Leaked(iscsiSessions(t, lt.IQN))
}

// differing counts the bytes of want that got does not hold at their
// place.
func differing(got, want []byte) int64 {
	var n int64
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			n++
		}
	}
	return n
}

// TestFaultMultipathISCSIUnstageNotFinished: an unstage during an outage
// too long to wait out makes the map fail I/O, and then cannot unmount (a
// file is still open in the staging mount). The volume stays staged, and
// its map queues I/O again, as before the unstage: the next outage does
// not fail its writes at once. Once the file is closed and the paths are
// back, the unstage finishes: the kubelet's retry, since the first flush
// reports the writes the map failed meanwhile.
func TestFaultMultipathISCSIUnstageNotFinished(t *testing.T) {
	vm.RequireGuest(t)
	queueForever(t)
	fault := reliability.StartFault(t, "iSCSI multipath: an unstage that stopped queueing and could not unmount, then every path back")
	node := fault.Node(startAgent(t, slog.New(slog.NewTextHandler(csitest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))))
	lt := iscsi.NewLIOTarget(t, "127.0.0.1:3260", "127.0.0.2:3260")
	wwid := lt.AddLUN(0, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	staging := filepath.Join(t.TempDir(), "staging")
	os.MkdirAll(staging, 0o750)
	id := "vol-notfinished"
	dm, _ := stageMultipath(t, ctx, node, lt, lt.IQN, wwid, id, staging)
	f, err := os.Create(filepath.Join(staging, "open"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	lt.Vanish(1)
	lt.Vanish(2)
	// 12 s: the unstage waits half of it for a path, then stops queueing.
	uctx, ucancel := context.WithTimeout(ctx, 12*time.Second)
	defer ucancel()
	_, err = node.NodeUnstageVolume(uctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	t.Logf("NodeUnstageVolume with a file open in the staging mount, every path down: %v", err)
	if err == nil {
		t.Fatal("NodeUnstageVolume with a file open in the staging mount: OK, want an error")
	}
	if !isMountRoot(t, staging) {
		t.Fatal("the staging mount is gone")
	}
	// The agent gives the queueing back as the call ends.
	waitFor(t, 20*time.Second, "the map to queue I/O again", func() bool {
		return strings.Contains(mapFeatures(t, dm.ID.DMName), "queue_if_no_path")
	})

	f.Close()
	lt.Restore(1)
	lt.Restore(2)
	unstage := func() error {
		_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		return err
	}
	if err := unstage(); err != nil {
		t.Logf("NodeUnstageVolume with the file closed and the paths back: %v", err)
		if err := unstage(); err != nil {
			t.Fatalf("NodeUnstageVolume retried: %v", err)
		}
	}
	n := iscsiSessions(t, lt.IQN)
	fault.Leaked(n)
	if n != 0 {
		t.Errorf("%d sessions left", n)
	}
}
