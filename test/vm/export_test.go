package vm

// WithHangFirstBoot exports withHangFirstBoot to the package's tests.
var WithHangFirstBoot = withHangFirstBoot

// WithFakeOopsFirstBoot exports withFakeOopsFirstBoot to the package's tests.
var WithFakeOopsFirstBoot = withFakeOopsFirstBoot

// FakeOopsArg exports fakeOopsArg to the package's tests.
const FakeOopsArg = fakeOopsArg
