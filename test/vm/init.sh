#!/bin/sh
# PID 1 of a berth test guest (busybox sh). Reads /berth-vm/config.sh written
# by the host harness, prepares the system, runs the test binary with its
# output on ttyS1 and powers off. Its last line on ttyS1 and on the console,
# "BERTH-VM-EXIT <status>", is what the host waits for.
#
# With BERTH_VM_SYSTEMD=1 it mounts the Debian root disk (/dev/vda), installs
# a service that runs "init.sh tests" and switches root to systemd.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root

say() { echo "berth-vm: $*" >/dev/console; }

finish() { # status
	sync
	echo "BERTH-VM-EXIT $1" >/dev/ttyS1 # last close of ttyS1: waits until sent
	echo "BERTH-VM-EXIT $1" >/dev/console
	if [ "$$" = 1 ]; then
		poweroff -f
	else
		systemctl poweroff --force --force
	fi
	sleep 60
}

fail() {
	say "$*"
	finish 255
}

# prepare loads modules and sets up the network links.
prepare() {
	if [ -n "$BERTH_VM_MODULES" ]; then
		modprobe -a $BERTH_VM_MODULES || fail "modprobe $BERTH_VM_MODULES failed"
	fi
	if [ -n "$BERTH_VM_NICS" ]; then
		modprobe -a virtio_pci virtio_net || fail "cannot load virtio_net"
		i=0
		for a in $BERTH_VM_NICS; do
			# NIC i is the one whose MAC ends in i (machine.go): the
			# kernel may name the NICs in another order.
			suffix=$(printf ':%02x' "$i")
			dev=eth$i
			for n in /sys/class/net/eth*; do
				case "$(cat "$n/address")" in *"$suffix") dev=${n##*/} ;; esac
			done
			ip link set "$dev" up || fail "no $dev"
			ip addr add "$a" dev "$dev" || fail "cannot set $a on $dev"
			i=$((i + 1))
		done
	fi
}

# send_cover sends the coverage files the test binary wrote to the host,
# a base64 line at a time (BERTH_VM_COVER: the host collects coverage).
send_cover() {
	for f in /berth-vm/cover/*; do
		[ -f "$f" ] || continue
		n=${f##*/}
		base64 "$f" | while read -r l; do echo "BERTH-VM-COVER $n $l"; done
	done >/dev/ttyS1
}

# run_tests runs the test binary and powers off.
run_tests() {
	stty -F /dev/ttyS1 raw -echo 2>/dev/null
	cd /berth-vm/pkg || fail "no /berth-vm/pkg"
	[ "$BERTH_VM_COVER" = 1 ] && mkdir -p /berth-vm/cover
	read -r up _ </proc/uptime
	echo "BERTH-VM-START guest uptime ${up}s" >/dev/console
	/berth-vm/guest.test "$@" </dev/ttyS1 >/dev/ttyS1 2>&1
	status=$?
	cd /
	[ "$BERTH_VM_COVER" = 1 ] && send_cover
	finish $status
}

mode=$1
. /berth-vm/config.sh # sets the test binary's arguments

if [ "$mode" = tests ]; then # systemd mode, from berth-vm-tests.service
	prepare
	# systemd-udevd runs already; the daemons asked for start as units.
	if [ "$BERTH_VM_ISCSID" = 1 ]; then
		modprobe -a iscsi_tcp sd_mod || fail "cannot load iscsi_tcp"
		systemctl start iscsid.service || fail "iscsid.service did not start"
	fi
	if [ "$BERTH_VM_MULTIPATHD" = 1 ]; then
		systemctl start multipathd.service || fail "multipathd.service did not start"
	fi
	run_tests "$@"
fi

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

case " $(cat /proc/cmdline) " in
*" berth_vm_hang "*) # the harness's test of its boot watchdog
	say "hanging as asked (berth_vm_hang)"
	while :; do sleep 3600; done
	;;
esac

if [ "$BERTH_VM_SYSTEMD" = 1 ]; then
	modprobe -a virtio_pci virtio_blk || fail "cannot load virtio_blk"
	i=0
	while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do
		sleep 0.05
		i=$((i + 1))
	done
	mkdir -p /newroot
	mount -t ext4 /dev/vda /newroot || fail "cannot mount the root disk /dev/vda"
	# The run's files go to tmpfs mounts (faster than the snapshot disk).
	mkdir -p /newroot/berth-vm /newroot/usr/lib/modules
	mount -t tmpfs -o mode=0755 tmpfs /newroot/berth-vm
	mount -t tmpfs -o mode=0755 tmpfs /newroot/usr/lib/modules
	cp -a /berth-vm/. /newroot/berth-vm/
	cp -a /usr/bin/berth /newroot/berth-vm/berth
	ln -sf /berth-vm/berth /newroot/usr/bin/berth
	cp -a /usr/lib/modules/. /newroot/usr/lib/modules/
	for f in $BERTH_VM_FILES; do
		mkdir -p "/newroot$(dirname "$f")"
		cp -a "$f" "/newroot$f"
	done
	u=/newroot/etc/systemd/system
	cat >$u/berth-vm-tests.service <<-EOF
		[Unit]
		Description=berth in-guest tests
		After=multi-user.target
		[Service]
		Type=simple
		ExecStart=/berth-vm/init.sh tests
		StandardOutput=journal+console
	EOF
	mkdir -p $u/multi-user.target.wants
	ln -sf ../berth-vm-tests.service $u/multi-user.target.wants/
	# Nothing starts by default that the tests do not ask for (units stay
	# startable with systemctl): no daemons, gettys, timers or boot-time scans.
	rm -f $u/*.wants/multipathd.service $u/*.wants/multipathd.socket $u/*.wants/open-iscsi.service \
		$u/*.wants/iscsid.socket $u/*.wants/nvmf-autoconnect.service $u/*.wants/nvmefc-boot-connections.service \
		$u/*.wants/e2scrub_reap.service $u/*.wants/systemd-pstore.service $u/*.wants/uuidd.socket \
		$u/*.wants/getty@tty1.service $u/timers.target.wants/*
	for s in serial-getty@ttyS0 serial-getty@ttyS1 systemd-logind systemd-update-utmp systemd-update-utmp-runlevel; do
		ln -sf /dev/null "$u/$s.service"
	done
	hostname "${BERTH_VM_HOSTNAME:-guest}" && echo "${BERTH_VM_HOSTNAME:-guest}" >/newroot/etc/hostname
	mount --move /dev /newroot/dev
	umount /proc /sys
	exec switch_root /newroot /lib/systemd/systemd
fi

mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd
mkdir -p /run/lock/iscsi /run/udev /run/multipath /var/lib/iscsi

modprobe configfs 2>/dev/null
mount -t configfs configfs /sys/kernel/config || fail "cannot mount configfs"
[ -d /sys/kernel/debug ] && mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null

hostname "${BERTH_VM_HOSTNAME:-guest}"
ip link set lo up
prepare

if [ "$BERTH_VM_UDEV" = 1 ]; then
	# Each step says when it starts: a guest stuck here shows where.
	say "starting systemd-udevd"
	/usr/lib/systemd/systemd-udevd --daemon || fail "systemd-udevd did not start"
	say "udevadm trigger"
	udevadm trigger --type=subsystems --action=add
	udevadm trigger --type=devices --action=add
	say "udevadm settle"
	udevadm settle --timeout=30 || fail "udevadm settle timed out"
fi
if [ "$BERTH_VM_ISCSID" = 1 ]; then
	modprobe -a iscsi_tcp sd_mod || fail "cannot load iscsi_tcp"
	iscsid || fail "iscsid did not start"
fi
if [ "$BERTH_VM_MULTIPATHD" = 1 ]; then
	modprobe -a dm_multipath dm_round_robin dm_service_time dm_queue_length || fail "cannot load dm_multipath"
	# In the foreground of a background job, so its messages reach the console.
	multipathd -d -s -v2 </dev/null >/dev/console 2>&1 &
fi

run_tests "$@"
