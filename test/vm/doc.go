// Package vm runs Go tests inside QEMU guests that boot Debian's cloud kernel,
// so that code talking to NVMe/TCP, iSCSI (open-iscsi and LIO), nvmet,
// dm-multipath and udev is tested against the real kernel, never against the
// host (whose kernel has none of them).
//
// A package keeps the host half and the guest half of a VM test side by side:
//
//	// The host entry point: builds this package's test binary, boots a guest,
//	// runs the in-guest tests there and reports each one as a subtest.
//	func TestVMNVMe(t *testing.T) {
//		vm.RunGuestTests(t, vm.WithTestRun("^TestGuestNVMe"))
//	}
//
//	// Runs as root inside the guest; skipped on the host.
//	func TestGuestNVMeConnect(t *testing.T) {
//		vm.RequireGuest(t)
//		tgt := target.NewNVMeTarget(t, target.NVMeNamespace{Size: 64 << 20})
//		...
//	}
//
// Host entry points are named TestVM* (make vm-test runs -run '^TestVM'); the
// in-guest tests have other names and call RequireGuest.
//
// What RunGuestTests does: it runs test/vm/image/build.sh once per test process
// (a cached Debian cloud kernel with its modules and a Debian root made with
// mmdebstrap, kept in $BERTH_VM_CACHE or ~/.cache/berth-vm), builds the calling
// package with `go test -c` and the berth binary with `go build` (both
// CGO_ENABLED=0), packs them into an initramfs next to busybox, the storage
// tools and the kernel modules, and boots it with TCG. The guest's init mounts
// /proc, /sys, devtmpfs, configfs and tmpfs on /run and /tmp, loads the
// requested modules, starts the requested daemons and runs the test binary as
// root with -test.v=test2json. The console (ttyS0) goes to t.Logf; the test
// output travels over a second serial port (ttyS1) and is decoded with
// `go tool test2json`, so every in-guest test becomes a host subtest of its own
// with its output. A kernel panic, a guest that hangs past its timeout or one
// that never reports its exit status fails the host test with the console tail
// and the QEMU command line that reproduces the run; the run directory (kernel
// command line, initramfs) is kept when the test fails.
//
// In the guest: the berth binary is /usr/bin/berth; the package's testdata
// directory is the working directory's testdata; env BERTH_VM_GUEST=1; the
// kernel modules of the storage stack are available through modprobe (the
// functions of package target load what they use).
//
// Several guests on one host test: Boot starts a guest and returns at once;
// NewLink gives two guests a private Ethernet link (QEMU socket netdev over
// host loopback), WithNIC gives a guest an address on it; SignalHost and
// WaitHost or NextHost (guest side) with Machine.WaitSignal and Machine.Send (host side)
// let the host sequence the guests, for example to kill a target guest while
// an initiator guest watches its path go down. Machine.Step and ServeSteps
// do so by step name (a guest runs whichever step the host names), and
// Groups narrows a run to the groups of steps an environment variable
// names.
//
// Options: WithTestRun, WithTestArgs, WithPackage, WithModules, WithTimeout,
// WithMemory, WithCPUs, WithUdev, WithIscsid, WithMultipathd, WithSystemd,
// WithExtraFiles, WithEnv, WithBerthTags, WithNIC, WithName, WithKernelArgs. WithSystemd
// boots the Debian root (a snapshot of a disk image) with systemd as PID 1
// instead of the busybox init; the tests then run from a service after
// multi-user.target. WithBerthTags builds the guest's berth with build tags
// (the crash suites use "failpoints"). WithKernel("trixie") boots Debian
// 13's 6.12 cloud kernel (NVMe in-band authentication on both sides) with
// the same Debian 12 root and tools; test/vm/image/build.sh trixie builds
// that image (current-trixie in the cache). WithKernel("trixie-backports")
// boots the newest cloud kernel of Debian 13's backports (7.3.4: nvmet with
// NVMe reservations, secure channel concatenation; build.sh
// trixie-backports after build.sh trixie, whose tlshd and nvme-cli it
// carries too; current-trixie-backports;
// a 37 MB download, split into linux-binary, linux-modules and linux-base
// packages; the initramfs guest starts its tests 5-6 s after QEMU starts
// on an idle host, like 6.12's). BERTH_VM_KERNEL_SUITE=trixie
// gives every guest without WithKernel that kernel, to run a package's
// guest tests once on it.
//
// Timing under TCG on two host cores: the initramfs guest starts its tests
// 2-10 s after QEMU starts (depending on host load; the 6.12 kernel a few
// seconds more, with its boot-time crypto self-tests off through the
// image's KERNEL_ARGS, cryptomgr.notests=1), the systemd guest much later; the console line "BERTH-VM-START guest uptime N" tells. A guest
// that has not started its tests after half its timeout (at most 150 s)
// is taken for stuck in early boot: it is killed, with its console in the
// log, and booted once more with the kernel's messages on. A second hang
// fails the test at its timeout.
//
// When QEMU or the image is missing the VM tests skip, unless BERTH_CI=1 is
// set: then they fail.
package vm
