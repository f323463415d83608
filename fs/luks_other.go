//go:build !linux

package fs

import "context"

// LUKSFormat is only supported on Linux.
func LUKSFormat(ctx context.Context, devPath string, passphrase []byte, o LUKSOptions) error {
	return unsupported("luksFormat " + devPath)
}

// LUKSOpen is only supported on Linux.
func LUKSOpen(ctx context.Context, devPath, name string, passphrase []byte, allowDiscards bool) error {
	return unsupported("open " + devPath)
}

// LUKSTestPassphrase is only supported on Linux.
func LUKSTestPassphrase(ctx context.Context, devPath string, passphrase []byte) error {
	return unsupported("test passphrase of " + devPath)
}

// LUKSClose is only supported on Linux.
func LUKSClose(ctx context.Context, name string) error { return unsupported("close " + name) }

// LUKSResize is only supported on Linux.
func LUKSResize(ctx context.Context, name string, passphrase []byte) error {
	return unsupported("resize " + name)
}

// CheckCryptsetup is only supported on Linux.
func CheckCryptsetup() error { return unsupported("cryptsetup") }
