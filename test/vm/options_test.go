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
