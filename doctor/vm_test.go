package doctor

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/berth-csi/berth/test/vm"
	"github.com/berth-csi/berth/test/vm/target"
)

// TestVMDoctor runs the berth binary's `berth doctor` on a guest that lacks iscsid, the NVMe/TCP
// modules and a shared kubelet mount, then fixes each and runs it again.
func TestVMDoctor(t *testing.T) {
	t.Parallel()
	vm.RunGuestTests(t, vm.WithTestRun("^TestGuestDoctor"))
}

// berthDoctor runs the guest's berth binary: `berth doctor args...`.
func berthDoctor(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command("/usr/bin/berth", append([]string{"doctor"}, args...)...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return out.String(), 0
	case errors.As(err, &ee):
		return out.String(), ee.ExitCode()
	}
	t.Fatalf("berth doctor: %v", err)
	return "", 0
}

func guestReport(t *testing.T, args []string) (Report, bool, string, int) {
	t.Helper()
	table, code := berthDoctor(t, args...)
	out, jcode := berthDoctor(t, append(args, "--json")...)
	if jcode != code {
		t.Fatalf("exit %d with --json, %d without", jcode, code)
	}
	var rep struct {
		Ready bool `json:"ready"`
		Report
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("--json: %v\n%s", err, out)
	}
	return rep.Report, rep.Ready, table, code
}

func failedNames(r Report) []string {
	var names []string
	for _, c := range r.Failed() {
		names = append(names, c.Name)
	}
	slices.Sort(names)
	return names
}

func TestGuestDoctor(t *testing.T) {
	vm.RequireGuest(t)
	if pid := findProcess(&Config{ProcRoot: "/proc"}, "iscsid"); pid != 0 {
		t.Fatalf("iscsid runs already (pid %d): the guest must start without it", pid)
	}
	want := []string{"iscsid", "module nvme_tcp", "mount propagation"}
	for _, m := range []string{"nvme_fabrics", "iscsi_tcp"} {
		if _, err := os.Stat("/sys/module/" + m + "/initstate"); err != nil {
			want = append(want, "module "+m)
		}
	}
	if _, err := os.Stat("/sys/module/nvme_tcp"); err == nil {
		t.Fatal("nvme_tcp is loaded already: the guest must start without it")
	}
	slices.Sort(want)

	// A kubelet directory on a private mount, as in a container whose
	// /var/lib/kubelet volume lacks Bidirectional propagation.
	kubelet := filepath.Join(t.TempDir(), "kubelet")
	if err := os.Mkdir(kubelet, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", kubelet, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(kubelet, unix.MNT_DETACH) })
	if err := unix.Mount("", kubelet, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	args := []string{"--transports", "iscsi,nvmeof", "--kubelet-dir", kubelet,
		"--endpoint", "unix://" + filepath.Join(kubelet, "plugins", "berth.csi.io", "csi.sock")}

	r, ready, table, code := guestReport(t, args)
	t.Logf("before:\n%s", table)
	if code != 1 || ready {
		t.Fatalf("exit %d, ready %v on a node without iscsid and nvme_tcp; want 1, false", code, ready)
	}
	if got := failedNames(r); !slices.Equal(got, want) {
		t.Fatalf("failed checks %v, want %v", got, want)
	}
	for _, fix := range []string{
		"iscsid (fail): systemctl enable --now iscsid",
		"module nvme_tcp (fail): modprobe nvme_tcp",
		"mount propagation (fail): in Kubernetes mount " + kubelet + " with mountPropagation: Bidirectional",
	} {
		if !strings.Contains(table, fix) {
			t.Errorf("report lacks the fix %q", fix)
		}
	}

	// Apply the fixes.
	target.StartIscsid(t)
	target.LoadModules(t, "nvme_fabrics", "nvme_tcp")
	if err := unix.Mount("", kubelet, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}

	r, ready, table, code = guestReport(t, args)
	t.Logf("after:\n%s", table)
	if code != 0 || !ready || len(r.Failed()) != 0 {
		t.Fatalf("exit %d, ready %v, failed %v after the fixes; want 0, true, none", code, ready, failedNames(r))
	}
	for _, name := range []string{"iscsid", "module nvme_tcp", "mount propagation", "iscsi initiator name", "tool iscsiadm"} {
		if c := find(t, r, name); c.Status != OK {
			t.Errorf("%s = %s (%s) after the fixes", name, c.Status, c.Detail)
		}
	}
}
