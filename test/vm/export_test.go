package vm

// WithHangFirstBoot exports withHangFirstBoot to the package's tests.
var WithHangFirstBoot = withHangFirstBoot
