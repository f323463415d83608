package vm

import "strings"

// fakeOopsArg on the kernel command line makes TestSmokeGuestKernelBugRerun
// log an oops of the first known bug (the harness's test of its rerun).
const fakeOopsArg = "berth_vm_fake_oops"

// knownKernelBugs are oopses of the guest kernels themselves that a test
// can hit by chance, each named by the function in the oops's RIP line.
// A guest run by RunGuestTests that hits one is booted once more; a second
// hit fails the test as any oops does.
var knownKernelBugs = []struct{ fn, about string }{
	// Debian 6.1 cloud kernel: a login the target refuses (a wrong CHAP
	// secret) queues the connection's cleanup work, which can release the
	// socket that iscsid's teardown has already released.
	{"iscsi_sw_tcp_release_conn", "iscsi_tcp releasing the connection of a refused login"},
	// Debian 13 backports' 7.3 cloud kernel under TCG with two vCPUs,
	// at boot (~2-3 s, before any test): "Oops: int3" in
	// sched_clock_cpu from the timer tick, while sched_clock_init_late
	// patches the __sched_clock_stable static branch ("sched_clock:
	// Marking stable"): a vCPU runs the int3 of a text patch the other
	// has finished. Seen once in 21 boots.
	{"sched_clock_cpu", "7.3 under TCG: a vCPU trapping on the int3 of the sched_clock static branch patched at boot"},
}

// int3Oops is the oops of a vCPU that ran the int3 of a kernel text patch
// (a static branch, text_poke_bp) that its sibling had finished: under
// multi-threaded TCG the translated code can lag the patch (see tcgAccel,
// which runs kernels from 7 single-threaded for it). An int3 in kernel
// text comes from nothing else berth's guests run (no kprobes), so any
// such oops is this bug, wherever its RIP is: seen in sched_clock_cpu and
// ktime_get_update_offsets_now (7.3) and in inet_ehashfn (6.12, the
// static key of net_get_random_once flipped by the first TCP connection).
const int3Oops = "Oops: int3"

// knownKernelBug returns what is known of the bug whose oops RIP line this
// console line is, or "". oops is the oops's first line.
func knownKernelBug(oops, line string) string {
	_, rip, ok := strings.Cut(line, "RIP: ")
	if !ok {
		return ""
	}
	if strings.Contains(oops, int3Oops) {
		return "a vCPU trapping on the int3 of a kernel text patch that its sibling finished, under multi-threaded TCG"
	}
	for _, b := range knownKernelBugs {
		if strings.Contains(rip, b.fn+"+") {
			return b.about
		}
	}
	return ""
}
