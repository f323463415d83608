// Package iscsi attaches iSCSI volumes through open-iscsi (iscsid and
// iscsiadm), with CHAP and dm-multipath.
//
// # What an attach does
//
// For each portal the volume names (and only those; SendTargets discovery
// runs only when the volume asks for it, and stores nothing):
//
//  1. iscsiadm creates the node record for exactly this target and portal
//     (`iscsiadm -m node -o new -T <iqn> -p <ip:port[,tpgt]> -I <iface>`,
//     which copies iscsid.conf's node.* settings into it). Host names are
//     resolved first: sysfs and node records know portals by address.
//  2. berth edits the record in place, under open-iscsi's database lock:
//     node.startup = manual, node.session.scan = manual, the session
//     parameters and the CHAP credentials. Credentials never travel in an
//     argument vector (world-readable in /proc/<pid>/cmdline), a log line
//     or an error; the file is mode 0600 before they are written. A login
//     that fails has iscsiadm delete the record again.
//  3. iscsiadm -m node ... --login. Exit code 24 (ISCSI_ERR_LOGIN_AUTH_FAILED)
//     becomes errdefs.ErrPermissionDenied, iscsid trouble
//     errdefs.ErrUnavailable with what to do.
//  4. The session is found in /sys/class/iscsi_session and
//     /sys/class/iscsi_connection; a device waiter is subscribed, and
//     exactly the volume's LUN is scanned ("0 T L" into
//     /sys/class/scsi_host/hostH/scan). A missing LUN is an error at
//     once, not a timeout.
//  5. The disk is checked against the volume's WWID.
//
// With several portals and multipathd running, the device returned is the
// dm-multipath map over every path; a portal that does not answer leaves
// the map degraded (Health reports it), while wrong credentials, a missing
// LUN or a WWID mismatch on any portal fail the attach. Without multipathd
// several portals are an error, unless volume_context multipath is "false":
// then the first portal that answers is used alone. A single path that a
// multipathd claiming every disk has put under a map is returned as that
// map.
//
// A volume with CHAP enabled parses without secrets (an unstage after a
// restart has none, and Detach needs none); Attach then refuses with
// ErrInvalidArgument before touching the node.
//
// Detach removes the multipath map, then the LUN's disk, and logs out of a
// session only when no SCSI device is left on it: other volumes on the
// same target keep their session. The node record goes with the session.
// A session whose target vanished does not hold the detach: its disk is set
// offline before removal, so the caller's deadline bounds everything.
//
// # volume_context
//
// The keys (csi-driver-iscsi's and berth's own), their ranges and the CHAP
// secrets are documented once, in docs/volume-context.md; ParseVolume
// implements them.
//
// # Running in a container
//
// iscsid must run on the host (its sessions outlive berth's container), and
// iscsiadm talks to it over an abstract unix socket, so the DaemonSet needs
// hostNetwork: true. The iscsiadm in the container must match the host's
// iscsid and record format; the robust setup runs the host's own binary
// through a wrapper given with --iscsiadm:
//
//	#!/bin/sh
//	# /usr/local/sbin/iscsiadm-host: run the host's iscsiadm
//	exec chroot /host /sbin/iscsiadm "$@"
//
// with the host's root mounted at /host (hostPath /, read-only is not
// enough: records are written). nsenter --mount=/proc/1/ns/mnt -- iscsiadm
// "$@" works too when the pod has hostPID: true. The wrapper passes its
// arguments through unchanged; berth never puts a secret among them.
//
// berth itself reads and writes open-iscsi's records, so the host's
// /etc/iscsi (and /var/lib/iscsi on distributions that keep records there)
// must be mounted at the same paths in the container, with /run/lock/iscsi
// (the record lock shared with iscsiadm), /sys and /dev. The same applies to
// multipathd: --multipathd names a wrapper running the host's multipathd
// client, e.g. `exec chroot /host /sbin/multipathd "$@"`.
//
// The node must have open-iscsi installed with an initiator name in
// /etc/iscsi/initiatorname.iscsi, iscsid running, and the iscsi_tcp module
// loaded; for multipath, multipath-tools with multipathd running.
package iscsi
