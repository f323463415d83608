// Package target sets up storage targets inside a berth test guest: NVMe/TCP
// subsystems through the kernel's nvmet configfs and iSCSI targets through
// LIO configfs, each backed by loop devices over sparse files in tmpfs, with
// fixed identities (serial, UUID, NGUID, WWN) so what the initiator sees is
// known in advance. It also starts the initiator daemons (iscsid, multipathd,
// systemd-udevd) when a test needs them.
//
// Everything here runs as root inside the guest (see package vm); each
// constructor registers its teardown with t.Cleanup. Tests that break a path
// use RemovePort/AddPort (NVMe) or SetEnabled/RemovePortal (iSCSI); tests that
// grow a volume use Grow.
package target
