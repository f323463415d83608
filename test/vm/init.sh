#!/bin/sh
# PID 1 of a berth test guest (busybox sh). Reads /berth-vm/config.sh written
# by the host harness, prepares the system, runs the test binary with its
# output on ttyS1 and powers off. The last console line it writes,
# "BERTH-VM-EXIT <status>", is what the host waits for.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root

fail() {
	echo "berth-vm: $*" >/dev/console
	echo "BERTH-VM-EXIT 255" >/dev/console
	sync
	poweroff -f
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd
mkdir -p /run/lock/iscsi /run/udev /run/multipath /var/lib/iscsi

. /berth-vm/config.sh

modprobe configfs 2>/dev/null
mount -t configfs configfs /sys/kernel/config || fail "cannot mount configfs"
[ -d /sys/kernel/debug ] && mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null

hostname "${BERTH_VM_HOSTNAME:-guest}"
ip link set lo up
ip addr add 127.0.0.2/8 dev lo 2>/dev/null

if [ -n "$BERTH_VM_MODULES" ]; then
	modprobe -a $BERTH_VM_MODULES || fail "modprobe $BERTH_VM_MODULES failed"
fi

if [ -n "$BERTH_VM_NICS" ]; then
	modprobe -a virtio_pci virtio_net || fail "cannot load virtio_net"
	i=0
	for a in $BERTH_VM_NICS; do
		ip link set "eth$i" up || fail "no eth$i"
		ip addr add "$a" dev "eth$i" || fail "cannot set $a on eth$i"
		i=$((i + 1))
	done
fi

if [ "$BERTH_VM_UDEV" = 1 ]; then
	/usr/lib/systemd/systemd-udevd --daemon || fail "systemd-udevd did not start"
	udevadm trigger --type=subsystems --action=add
	udevadm trigger --type=devices --action=add
	udevadm settle --timeout=30 || fail "udevadm settle timed out"
fi
if [ "$BERTH_VM_ISCSID" = 1 ]; then
	modprobe -a iscsi_tcp sd_mod || fail "cannot load iscsi_tcp"
	iscsid || fail "iscsid did not start"
fi
if [ "$BERTH_VM_MULTIPATHD" = 1 ]; then
	modprobe -a dm_multipath dm_round_robin dm_service_time scsi_dh_alua || fail "cannot load dm_multipath"
	multipathd || fail "multipathd did not start"
fi

stty -F /dev/ttyS1 raw -echo 2>/dev/null
cd /berth-vm/pkg || fail "no /berth-vm/pkg"
echo "BERTH-VM-START" >/dev/console
/berth-vm/guest.test "$@" </dev/ttyS1 >/dev/ttyS1 2>&1
status=$?
cd /
sync
echo "BERTH-VM-EXIT $status" >/dev/console
poweroff -f
