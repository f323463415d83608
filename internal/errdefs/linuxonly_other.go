//go:build !linux

package errdefs

// berth is a Linux node agent: the packages below agent reach the block
// layer, the mount table, sysfs and the NVMe and iSCSI host drivers, and
// none of them has a counterpart elsewhere. A build for another OS stops
// here, at the first package every other imports, with this name in its
// error, rather than at whichever function is missing first.
var _ = berth_builds_only_on_linux
