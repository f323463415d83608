#!/bin/sh
# The kernel steps of staging NVMe/TCP namespaces by hand, the baseline
# berth's NodeStageVolume is measured against: one connect written to
# /dev/nvme-fabrics, then for each namespace (in parallel) wait for its
# block device, mkfs.ext4 and mount.
#
# usage: raw-stage.sh NQN TRADDR TRSVCID HOSTNQN HOSTID MOUNTROOT NSID...
# MOUNTROOT "-" stops once the block devices exist (the attach alone).
#
# mkfs.ext4 runs with the options berth formats with (no discard pass,
# lazy inode table and journal initialisation), so that both sides do
# the same work on the device. FSTYPE=xfs makes xfs instead (mkfs.xfs
# without a discard pass, as berth runs it).
set -eu
nqn=$1 traddr=$2 trsvcid=$3 hostnqn=$4 hostid=$5 root=$6
shift 6

printf 'transport=tcp,traddr=%s,trsvcid=%s,nqn=%s,hostnqn=%s,hostid=%s' \
	"$traddr" "$trsvcid" "$nqn" "$hostnqn" "$hostid" >/dev/nvme-fabrics

stage() {
	ns=$1 dev=
	while [ -z "$dev" ]; do
		for d in /sys/block/nvme*n*; do
			name=${d##*/}
			case $name in nvme*c*) continue ;; esac # hidden multipath paths
			[ "$(cat "$d/nsid" 2>/dev/null)" = "$ns" ] || continue
			[ "$(cat "$d/device/subsysnqn" 2>/dev/null)" = "$nqn" ] || continue
			[ -b "/dev/$name" ] && dev=/dev/$name
		done
		[ -n "$dev" ] || sleep 0.01
	done
	[ "$root" = - ] && return
	if [ "${FSTYPE:-ext4}" = xfs ]; then
		/usr/sbin/mkfs.xfs -q -f -K "$dev"
	else
		/usr/sbin/mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1,nodiscard "$dev"
	fi
	mkdir -p "$root/$ns"
	mount -t "${FSTYPE:-ext4}" "$dev" "$root/$ns"
}

pids=
for ns in "$@"; do
	stage "$ns" &
	pids="$pids $!"
done
for p in $pids; do
	wait "$p"
done
