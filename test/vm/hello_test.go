package vm_test

import (
	"os"
	"testing"

	"github.com/berth-csi/berth/test/vm"
)

func TestVMHello(t *testing.T) {
	vm.RunGuestTests(t, vm.WithTestRun("^TestGuestHello"))
}

func TestGuestHello(t *testing.T) {
	vm.RequireGuest(t)
	b, err := os.ReadFile("/proc/version")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel: %s", b)
}
