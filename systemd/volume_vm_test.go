package systemd

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestGuestSystemdBerthVolume stages an NVMe/TCP volume through the real
// berth, socket-activated by systemd, restarts berth.service with the
// volume in use, and unstages it through the new process: the mounts
// live in the host's mount namespace and outlive the service, and the
// restarted berth knows the volume from its state alone.
func TestGuestSystemdBerthVolume(t *testing.T) {
	vm.RequireGuest(t)
	// berth has no CAP_SYS_MODULE: on a node the initiator modules come
	// from modules-load.d; here the test loads them (from the guest's
	// /usr/lib/modules), as NewNVMeTarget does for the target side.
	target.LoadModules(t, "nvme_fabrics", "nvme_tcp")
	nqn := "nqn.2026-01.io.berth:systemd-restart"
	tgt := target.NewNVMeTarget(t, target.NVMeConfig{NQN: nqn, Ports: []string{"127.0.0.1:4420"}})
	ns := tgt.Namespace(1)

	const (
		volID   = "pv-systemd-restart"
		staging = "/var/lib/kubelet/plugins/kubernetes.io/csi/berth.csi.io/9f1c3e/globalmount"
		podDir  = "/var/lib/kubelet/pods/6a2b7c1e-0000-4000-8000-000000000001/volumes/kubernetes.io~csi/" + volID
	)
	tpath := filepath.Join(podDir, "mount")
	for _, d := range []string{staging, podDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}

	sock := installBerth(t)
	// Registered after the target: runs first, so that a failed run leaves
	// no mount or controller that keeps the target's cleanup from working.
	t.Cleanup(func() {
		unix.Unmount(tpath, 0)
		unix.Unmount(staging, 0)
		for _, c := range subsysControllers(t, nqn) {
			os.WriteFile(filepath.Join("/sys/class/nvme", c, "delete_controller"), []byte("1"), 0o200)
		}
	})
	if p := unitProps(t, "berth.service"); p["ActiveState"] != "inactive" {
		t.Fatalf("berth.service started before any connection: %v", p)
	}

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	vcap := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	stageReq := &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, VolumeCapability: vcap,
		VolumeContext: map[string]string{
			"transport": "nvmeof", "nqn": nqn, "traddr": "127.0.0.1", "trsvcid": "4420",
			"nsid": "1", "uuid": ns.UUID,
		},
	}
	publishReq := &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, TargetPath: tpath, VolumeCapability: vcap,
		VolumeContext: stageReq.VolumeContext,
	}

	// The first call is NodeStageVolume itself: it starts berth.
	if _, err := node.NodeStageVolume(ctx, stageReq, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	p := waitUnit(t, "berth.service", "active", 30*time.Second, func(p map[string]string) bool { return p["ActiveState"] == "active" })
	pid := p["MainPID"]
	if _, err := node.NodePublishVolume(ctx, publishReq); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	if ctrls := subsysControllers(t, nqn); len(ctrls) != 1 {
		t.Fatalf("controllers of %s after staging: %v, want one", nqn, ctrls)
	}
	hostMounts(t, "staged", "/dev/nvme", map[string]bool{staging: true, tpath: true})

	data := make([]byte, 1<<20)
	rand.Read(data)
	sum := sha256.Sum256(data)
	file := filepath.Join(tpath, "data")
	writeSynced(t, file, data)

	// A restart with the volume in use: the mounts and the controller stay.
	systemctl(t, "restart", "berth.service")
	p = waitUnit(t, "berth.service", "active with a new pid", 60*time.Second, func(p map[string]string) bool {
		return p["ActiveState"] == "active" && p["MainPID"] != pid && p["MainPID"] != "0"
	})
	newPid := p["MainPID"]
	t.Logf("berth pid %s, after systemctl restart %s", pid, newPid)
	if own, host := mntNS(t, newPid), mntNS(t, "1"); own != host {
		t.Fatalf("berth pid %s runs in mount namespace %s, the host's is %s", newPid, own, host)
	}
	hostMounts(t, "after the restart", "/dev/nvme", map[string]bool{staging: true, tpath: true})
	if ctrls := subsysControllers(t, nqn); len(ctrls) != 1 {
		t.Fatalf("controllers of %s after the restart: %v, want one", nqn, ctrls)
	}
	if got, err := os.ReadFile(filepath.Join(staging, "data")); err != nil || sha256.Sum256(got) != sum {
		t.Fatalf("data after the restart: %d bytes, %v; checksum differs", len(got), err)
	}

	// The new process answers from its state: staging and publishing again
	// are no-ops, and the volume is healthy.
	if _, err := node.NodeStageVolume(ctx, stageReq, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("NodeStageVolume again after the restart: %v", err)
	}
	if _, err := node.NodePublishVolume(ctx, publishReq); err != nil {
		t.Fatalf("NodePublishVolume again after the restart: %v", err)
	}
	if p := unitProps(t, "berth.service"); p["MainPID"] != newPid {
		t.Fatalf("the restarted berth did not answer: %v", p)
	}
	hostMounts(t, "after staging and publishing again", "/dev/nvme", map[string]bool{staging: true, tpath: true})
	st, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: volID, VolumePath: tpath, StagingTargetPath: staging})
	if err != nil {
		t.Fatalf("NodeGetVolumeStats: %v", err)
	}
	if c := st.GetVolumeCondition(); c == nil || c.GetAbnormal() {
		t.Fatalf("volume condition after the restart: %v", c)
	}
	var used int64
	for _, u := range st.GetUsage() {
		if u.GetUnit() == csi.VolumeUsage_BYTES {
			used = u.GetUsed()
		}
	}
	if used < int64(len(data)) {
		t.Fatalf("NodeGetVolumeStats: %d bytes used, the volume holds a %d byte file: %v", used, len(data), st)
	}
	if got, err := os.ReadFile(file); err != nil || sha256.Sum256(got) != sum {
		t.Fatalf("data through the pod's mount: %d bytes, %v; checksum differs", len(got), err)
	}

	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: tpath}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	hostMounts(t, "unstaged", "/dev/nvme", map[string]bool{staging: false, tpath: false})
	if ctrls := subsysControllers(t, nqn); len(ctrls) != 0 {
		t.Fatalf("controllers of %s after NodeUnstageVolume: %v", nqn, ctrls)
	}
	if p := unitProps(t, "berth.service"); p["MainPID"] != newPid || p["ActiveState"] != "active" {
		t.Fatalf("berth.service after unstaging: %v", p)
	}
}

// TestGuestSystemdBerthISCSIFenced stages a single-writer iSCSI volume
// through the real berth under the shipped unit's capabilities: the stage
// fences the LUN, which reads its reservation (PERSISTENT RESERVE IN)
// before taking it, and the unstage gives it back. LIO's pr/ attributes
// tell what the target holds.
func TestGuestSystemdBerthISCSIFenced(t *testing.T) {
	vm.RequireGuest(t)
	const (
		iqn    = "iqn.2026-01.io.berth:systemd-fenced"
		portal = "127.0.0.1:3260"
		volID  = "pv-systemd-iscsi-fenced"
		// Another kubelet staging path than the NVMe test's: each test
		// leaves its directory behind.
		staging = "/var/lib/kubelet/plugins/kubernetes.io/csi/berth.csi.io/4d2a7b/globalmount"
	)
	tgt := target.NewISCSITarget(t, target.ISCSIConfig{IQN: iqn, Portals: []string{portal}})
	initiator := target.InitiatorName(t)
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}

	sock := installBerth(t)
	// Registered after the target: runs first, so that a failed run leaves
	// no mount or session that keeps the target's cleanup from working.
	t.Cleanup(func() {
		unix.Unmount(staging, 0)
		exec.Command("iscsiadm", "-m", "node", "-T", iqn, "-p", portal, "-u").Run()
		exec.Command("iscsiadm", "-m", "node", "-T", iqn, "-p", portal, "-o", "delete").Run()
	})

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// Start berth first, so that the stage's time is the stage's own.
	if _, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("GetPluginInfo through %s: %v", sock, err)
	}
	node := csi.NewNodeClient(conn)

	stageReq := &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging,
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
		VolumeContext: map[string]string{"transport": "iscsi", "targetPortal": portal, "iqn": iqn, "lun": "0"},
	}
	start := time.Now()
	if _, err := node.NodeStageVolume(ctx, stageReq); err != nil {
		t.Fatalf("NodeStageVolume: %v (LUN 0: holder %q, registered %q)", err, tgt.PR(0, "res_holder"), tgt.PR(0, "res_pr_registered_i_pts"))
	}
	t.Logf("NodeStageVolume in %v", time.Since(start).Round(time.Millisecond))
	hostMounts(t, "staged", "/dev/sd", map[string]bool{staging: true})

	holder, typ, reg := tgt.PR(0, "res_holder"), tgt.PR(0, "res_pr_type"), tgt.PR(0, "res_pr_registered_i_pts")
	t.Logf("LUN 0 after the stage: holder %q, type %q", holder, typ)
	if !strings.Contains(holder, initiator) || !strings.Contains(typ, "Write Exclusive Access, Registrants Only") || !strings.Contains(reg, initiator) {
		t.Fatalf("LUN 0 after the stage: holder %q, type %q, registered %q; want %s holding Write Exclusive – Registrants Only", holder, typ, reg, initiator)
	}

	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	hostMounts(t, "unstaged", "/dev/sd", map[string]bool{staging: false})
	holder, reg = tgt.PR(0, "res_holder"), tgt.PR(0, "res_pr_registered_i_pts")
	t.Logf("LUN 0 after the unstage: holder %q", holder)
	if !strings.Contains(holder, "No SPC-3 Reservation holder") || strings.Contains(reg, "iqn.") {
		t.Fatalf("LUN 0 after the unstage: holder %q, registered %q; want neither a holder nor a registration", holder, reg)
	}
}

// installBerth installs the shipped units, changed only in the binary's
// path (/usr/bin/berth in the guest), starts berth.socket and returns the
// socket's path. berth.service is stopped when the test ends.
func installBerth(t *testing.T) string {
	t.Helper()
	const bin = "/usr/local/bin/berth"
	service := bytes.ReplaceAll(serviceUnit, []byte("ExecStart="+bin+" "), []byte("ExecStart=/usr/bin/berth "))
	if bytes.Equal(service, serviceUnit) {
		t.Fatalf("berth.service does not start %s", bin)
	}
	return startUnits(t, service)
}

// startUnits installs service (a variant of the shipped berth.service)
// and the shipped berth.socket as runtime units, starts the socket and
// returns its path. Cleanup stops both and, when the test failed, logs
// their journal.
func startUnits(t *testing.T, service []byte) string {
	t.Helper()
	dir := "/run/systemd/system"
	if err := os.WriteFile(filepath.Join(dir, "berth.service"), service, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "berth.socket"), socketUnit, 0o644); err != nil {
		t.Fatal(err)
	}
	systemctl(t, "daemon-reload")
	systemctl(t, "start", "berth.socket")
	t.Cleanup(func() {
		exec.Command("systemctl", "stop", "berth.service", "berth.socket").Run()
		if t.Failed() {
			out, _ := exec.Command("journalctl", "--no-pager", "-n", "80", "-u", "berth.service", "-u", "berth.socket").CombinedOutput()
			t.Logf("journal:\n%s", out)
		}
	})
	return unitValues(t, socketUnit, "ListenStream")[0]
}

// hostMounts checks, in PID 1's mount table (the host's namespace), which
// of the paths are mount points: ext4 from a device whose path starts
// with dev.
func hostMounts(t *testing.T, when, dev string, want map[string]bool) {
	t.Helper()
	f, err := os.Open("/proc/1/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mounts, err := mountinfo.GetMountsFromReader(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	for path, mounted := range want {
		var found *mountinfo.Info
		for _, m := range mounts {
			if m.Mountpoint == path {
				found = m
			}
		}
		switch {
		case mounted && found == nil:
			t.Fatalf("%s: %s is not mounted in the host's mount namespace", when, path)
		case mounted && (found.FSType != "ext4" || !strings.HasPrefix(found.Source, dev)):
			t.Fatalf("%s: %s is %s from %s, want ext4 from %s*", when, path, found.FSType, found.Source, dev)
		case !mounted && found != nil:
			t.Fatalf("%s: %s is still mounted (%s from %s)", when, path, found.FSType, found.Source)
		}
	}
}

// subsysControllers lists the NVMe controllers connected to subsystem nqn.
func subsysControllers(t *testing.T, nqn string) []string {
	t.Helper()
	ents, err := os.ReadDir("/sys/class/nvme")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var ctrls []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/nvme", e.Name(), "subsysnqn"))
		if err == nil && strings.TrimSpace(string(b)) == nqn {
			ctrls = append(ctrls, e.Name())
		}
	}
	return ctrls
}

func mntNS(t *testing.T, pid string) string {
	t.Helper()
	ns, err := os.Readlink(filepath.Join("/proc", pid, "ns", "mnt"))
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

func writeSynced(t *testing.T, path string, data []byte) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
