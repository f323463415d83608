package vm

import "testing"

func TestConfigValidateKernel(t *testing.T) {
	for _, tc := range []struct {
		opts []Option
		ok   bool
	}{
		{nil, true},
		{[]Option{WithKernel("trixie")}, true},
		{[]Option{WithKernel("trixie-backports")}, true},
		{[]Option{WithKernel("trixie-")}, false},
		{[]Option{WithKernel("-backports")}, false},
		{[]Option{WithKernel("trixie-security")}, false},
		{[]Option{WithKernel("../trixie")}, false},
		{[]Option{WithKernelArgs("nvme_core.multipath=N", "quiet")}, true},
		{[]Option{WithKernelArgs("a=b c")}, false},
		{[]Option{WithKernelArgs("init=/bin/sh")}, false},
		{[]Option{WithKernelArgs("")}, false},
	} {
		c := defaultConfig()
		c.kernel = ""
		for _, o := range tc.opts {
			o(c)
		}
		if err := c.validate(); (err == nil) != tc.ok {
			t.Errorf("kernel %q args %q: validate %v, want ok %v", c.kernel, c.kernelArgs, err, tc.ok)
		}
	}
}

func TestKnownKernelBugSchedClock(t *testing.T) {
	const oops = "[    2.938400] Oops: general protection fault: 0000 [#1] PREEMPT SMP NOPTI"
	if knownKernelBug(oops, "[    2.938461] RIP: 0010:sched_clock_cpu+0x9/0x1f0") == "" {
		t.Error("the 7.3 boot-time int3 in sched_clock_cpu is not a known kernel bug")
	}
	for _, l := range []string{
		"[    2.938461] RIP: 0010:sched_clock_cpu_idle+0x9/0x1f0",
		"[    2.964510]  update_rq_clock+0x39/0x160 sched_clock_cpu+0x9",
	} {
		if b := knownKernelBug(oops, l); b != "" {
			t.Errorf("%q: known kernel bug %q", l, b)
		}
	}
}

// An int3 oops is the TCG text-patch race wherever it strikes (here the
// 6.12 guest's, in inet_ehashfn); another oops at the same RIP is not.
func TestKnownKernelBugInt3(t *testing.T) {
	const rip = "[   14.776288] RIP: 0010:inet_ehashfn+0x33/0x120"
	if knownKernelBug("[   14.775353] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI", rip) == "" {
		t.Error("an int3 oops in inet_ehashfn is not a known kernel bug")
	}
	if b := knownKernelBug("[   14.775353] BUG: kernel NULL pointer dereference, address: 0000000000000008", rip); b != "" {
		t.Errorf("a NULL dereference in inet_ehashfn: known kernel bug %q", b)
	}
	if b := knownKernelBug("[   14.775353] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI", "[   14.776300]  inet_ehashfn+0x33/0x120"); b != "" {
		t.Errorf("a call trace line: known kernel bug %q", b)
	}
}

// Kernels from 7 boot under single-threaded TCG; older ones keep a host
// thread per vCPU.
func TestTCGAccel(t *testing.T) {
	for kv, want := range map[string]string{
		"6.1.0-57-cloud-amd64":       "tcg",
		"6.12.117+deb13-cloud-amd64": "tcg",
		"7.3.4+deb13-cloud-amd64":    "tcg,thread=single",
		"10.0.1-cloud-amd64":         "tcg,thread=single",
		"":                           "tcg",
	} {
		if got := tcgAccel(kv); got != want {
			t.Errorf("tcgAccel(%q) = %q, want %q", kv, got, want)
		}
	}
}
