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

if [ ${#pkgs[@]} -gt 0 ]; then
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
fi
