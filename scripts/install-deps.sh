#!/usr/bin/env bash
# Installs the Debian packages berth's build, tests and VM suite use.
# Idempotent: packages already present are not reinstalled.
set -euo pipefail

pkgs=()
need() { for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || pkgs+=("$p"); done; }

need e2fsprogs xfsprogs util-linux mount
need fdisk # sfdisk: fs host tests write partition tables
need qemu-system-x86 qemu-utils busybox-static cpio mmdebstrap kmod zstd
need systemd
need cryptsetup-bin # LUKS2 volumes: cryptsetup luksFormat/open/resize/close
# test/vm/image/build.sh: guest kernel, mmdebstrap root and initramfs; QEMU with its firmware
need qemu-system-x86 seabios ipxe-qemu busybox-static cpio mmdebstrap kmod gzip

# make e2e (BERTH_E2E_DEPS=1, make e2e-deps): a single-node Kubernetes on
# this host: the container runtime, CNI plugins, etcd, mmdebstrap for the
# test images, socat to carry the kubelet's probes between network
# namespaces. Not pulled by make deps.
e2e=${BERTH_E2E_DEPS:-0}
if [ "$e2e" = 1 ]; then
	need containerd runc containernetworking-plugins etcd-server mmdebstrap iproute2 util-linux socat
fi

if [ ${#pkgs[@]} -gt 0 ]; then
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	# The e2e cluster starts containerd and etcd itself, with its own
	# configuration: the packages' services must not start on install.
	nostart=
	if [ "$e2e" = 1 ] && [ ! -e /usr/sbin/policy-rc.d ]; then
		printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
		chmod 0755 /usr/sbin/policy-rc.d
		nostart=1
	fi
	status=0
	apt-get install -y -qq --no-install-recommends "${pkgs[@]}" || status=$?
	[ -z "$nostart" ] || rm -f /usr/sbin/policy-rc.d
	exit $status
fi
