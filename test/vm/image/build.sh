#!/usr/bin/env bash
# Builds and caches the guest image of berth's VM test suite, outside the repo:
#
#   stages/kernel-<key>/  vmlinuz + lib/modules of Debian's cloud kernel (never installed on the host)
#   stages/root-<key>/    tree/: Debian root made with mmdebstrap (tools, udev, systemd);
#                  root.ext4: the same as a disk image for guests booting systemd
#   stages/image-<key>/   base.cpio.gz: busybox, storage tools with their libraries, kernel modules;
#                  image.env: paths and kernel version read by the Go harness
#   current ->     the image-<key> directory of the last successful build
#   current-<suite> -> the same for an image with another suite's kernel (build.sh SUITE)
#
# build.sh SUITE (e.g. trixie) builds a second image: the same Debian root and tools
# with the cloud kernel of another Debian suite, downloaded through a private apt
# configuration in the cache (the host's apt configuration is not touched). Debian 13's
# kernel has NVMe in-band authentication (CONFIG_NVME_HOST_AUTH, CONFIG_NVME_TARGET_AUTH),
# which Debian 12's 6.1 kernel lacks. build.sh trixie-backports takes the newest cloud
# kernel of Debian 13's backports (7.3.4 in December 2026), whose nvmet has NVMe
# reservations (since 6.13; per-namespace resv_enable).
#
# Each key is a hash of the inputs of its stage (the code of the stage, the package list,
# the kernel package version, the apt sources), so a changed input rebuilds that stage and
# an unchanged one is reused without downloading anything.
#
# Environment: BERTH_VM_CACHE (cache directory), BERTH_VM_APT_SOURCES (apt sources file
# given to mmdebstrap; default: the host's own), BERTH_VM_KERNEL (kernel package name).
set -euo pipefail

log() { printf 'vm-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/../../.." && pwd)
cache=${BERTH_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-vm}

[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, apt-get download)"

# Host prerequisites.
missing=0
for tool in qemu-system-x86_64 busybox cpio mmdebstrap depmod modprobe mkfs.ext4 zstd; do
	command -v "$tool" >/dev/null 2>&1 || missing=1
done
/bin/busybox ash -c 'exit 0' 2>/dev/null || missing=1
if [ "$missing" = 1 ]; then
	log "installing host prerequisites with scripts/install-deps.sh"
	"$repo_root/scripts/install-deps.sh"
fi
ldd /bin/busybox >/dev/null 2>&1 && die "/bin/busybox is not static (install busybox-static)"

stages=$cache/stages
mkdir -p "$stages"
exec 9>"$cache/.lock"
if ! flock -n 9; then
	log "waiting for another build in $cache"
	flock 9
fi

# Apt sources given to mmdebstrap as its MIRROR argument (the file is copied into the root).
sources=${BERTH_VM_APT_SOURCES:-}
if [ -z "$sources" ]; then
	if [ -s /etc/apt/sources.list ] && grep -q '^[[:space:]]*deb ' /etc/apt/sources.list; then
		sources=/etc/apt/sources.list
	else
		for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
			[ -f "$f" ] && grep -qi debian "$f" && { sources=$f; break; }
		done
	fi
fi
[ -n "$sources" ] && [ -f "$sources" ] || die "no apt sources file found (set BERTH_VM_APT_SOURCES)"
. /etc/os-release
suite=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
# The suite of the guest kernel: the host's by default.
ksuite=${1:-$suite}
# A suite name, or a suite's backports (trixie-backports).
case ${ksuite%-backports} in *[!a-z]* | '') die "kernel suite $ksuite: want a Debian suite name such as trixie or trixie-backports" ;; esac

# Guest packages (the Debian root) and the tools copied into the initramfs.
packages=(
	open-iscsi e2fsprogs xfsprogs util-linux mount nvme-cli multipath-tools udev kmod
	systemd dbus iproute2 sg3-utils procps fdisk cryptsetup-bin
)
tools=(
	/usr/sbin/iscsiadm /usr/sbin/iscsid /usr/sbin/iscsi-iname
	/usr/sbin/nvme
	/usr/sbin/multipath /usr/sbin/multipathd /usr/sbin/kpartx /usr/sbin/dmsetup
	/usr/sbin/mke2fs /usr/sbin/mkfs.ext4 /usr/sbin/mkfs.ext3 /usr/sbin/e2fsck /usr/sbin/fsck.ext4
	/usr/sbin/resize2fs /usr/sbin/tune2fs /usr/sbin/dumpe2fs /usr/sbin/e2label
	/usr/sbin/mkfs.xfs /usr/sbin/xfs_repair /usr/sbin/xfs_growfs /usr/sbin/xfs_db
	/usr/sbin/xfs_admin /usr/sbin/xfs_info /usr/sbin/fsck.xfs /usr/sbin/xfs_io /usr/sbin/xfs_spaceman
	/usr/sbin/blkid /usr/sbin/wipefs /usr/sbin/losetup /usr/sbin/blockdev /usr/sbin/sfdisk
	/usr/sbin/fsck /usr/bin/lsblk /usr/bin/findmnt /usr/bin/mount /usr/bin/umount
	/usr/bin/kmod /usr/sbin/modprobe /usr/sbin/insmod /usr/sbin/rmmod /usr/sbin/lsmod
	/usr/bin/udevadm /usr/lib/systemd/systemd-udevd
	/usr/lib/udev/scsi_id /usr/lib/udev/ata_id /usr/lib/udev/cdrom_id
	/usr/bin/sg_inq /usr/bin/sg_vpd /usr/bin/sg_readcap
	/usr/sbin/ip
	/usr/sbin/cryptsetup
)
# Kernel modules available in every guest (loaded on demand with modprobe).
modules=(
	loop brd null_blk configfs dm_mod dm_multipath dm_round_robin dm_service_time
	dm_queue_length dm_delay sd_mod sg
	nvme_tcp nvme_fabrics nvmet nvmet_tcp
	iscsi_tcp libiscsi libiscsi_tcp scsi_transport_iscsi
	target_core_mod target_core_iblock target_core_file target_core_pscsi iscsi_target_mod
	xfs ext4 virtio_net virtio_pci virtio_blk virtio_console virtio_rng
	crc32c_generic crc32c_intel crct10dif_pclmul crc64_rocksoft af_packet
	overlay squashfs
	dummy
	dm_crypt xts essiv aesni_intel cryptd crypto_simd af_alg algif_skcipher algif_hash sha512_generic
)

sha() { sha256sum | cut -c1-16; }

# ---- kernel ----------------------------------------------------------------
kpkg=${BERTH_VM_KERNEL:-}
kernel_args= # extra kernel command line of the image's guests
lists_stamp="${BERTH_VM_KERNEL:-} $(stat -c %Y /var/lib/apt/lists 2>/dev/null) $({ cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } | sha)"
resolved=$cache/.kernel-resolved
if [ "$ksuite" != "$suite" ]; then
	# Another suite's kernel: apt reads a private configuration (APT_CONFIG)
	# whose sources name that suite on the first mirror of the host's own
	# sources, with its own lists and archive cache in the cache directory.
	kpkg=
	mirror=$(sed -n 's/^[[:space:]]*URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p; s/^[[:space:]]*deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' "$sources" | head -n1)
	[ -n "$mirror" ] || die "no mirror URI in $sources"
	aptdir=$cache/apt-$ksuite
	mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
	echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $ksuite main" >"$aptdir/sources.list"
	cat >"$aptdir/apt.conf" <<EOF
Dir::Etc::SourceList "$aptdir/sources.list";
Dir::Etc::SourceParts "/dev/null";
Dir::State::Lists "$aptdir/lists";
Dir::Cache "$aptdir/cache";
APT::Sandbox::User "root";
EOF
	export APT_CONFIG=$aptdir/apt.conf
	# Debian 13's kernel runs the self-tests of its built-in crypto
	# algorithms at boot: ~6 of the ~15 s it takes under TCG.
	kernel_args=cryptomgr.notests=1
	lists_stamp="$lists_stamp $(sha <"$aptdir/sources.list")"
	resolved=$cache/.kernel-resolved-$ksuite
fi
kernel_candidates() {
	apt-cache depends linux-image-cloud-amd64 2>/dev/null |
		sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1
}
# apt-cache is slow on a busy machine: its answer is kept until the apt lists change.
if [ -f "$resolved" ] && [ "$(head -n1 "$resolved")" = "$lists_stamp" ]; then
	kparts=
	{ read -r _; read -r kpkg kversion; read -r kparts || true; } <"$resolved"
else
	if [ -z "$kpkg" ]; then
		kpkg=$(kernel_candidates || true)
		if [ -z "$kpkg" ] || [ "$ksuite" != "$suite" ]; then
			log "apt-get update ($ksuite)"
			apt-get update -qq >&2
			kpkg=$(kernel_candidates || true)
		fi
	fi
	[ -n "$kpkg" ] || die "cannot find the cloud kernel package through linux-image-cloud-amd64"
	kversion=$(apt-cache policy "$kpkg" | sed -n 's/^ *Candidate: //p')
	[ -n "$kversion" ] && [ "$kversion" != "(none)" ] || die "no candidate version for $kpkg"
	if [ "$ksuite" = "$suite" ]; then
		lists_stamp="${BERTH_VM_KERNEL:-} $(stat -c %Y /var/lib/apt/lists 2>/dev/null) $({ cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } | sha)"
	fi
	# The backports' kernels (6.16 on) split the image package: it holds
	# nothing but dependencies on linux-binary-<ver> (vmlinuz) and
	# linux-modules-<ver> (the modules), at its own version. A third
	# package, linux-base-<ver> (1 MB), that nothing depends on, has the
	# config, modules.order and modules.builtin (without which modprobe
	# does not know built-in modules such as nvme_core).
	kparts=$(apt-cache depends "$kpkg=$kversion" 2>/dev/null |
		sed -n 's/^ *Depends: \(linux-\(binary\|modules\)-[0-9][^ ]*\)$/\1/p' | sort -u | tr '\n' ' ')
	printf '%s\n%s %s\n%s\n' "$lists_stamp" "$kpkg" "$kversion" "$kparts" >"$resolved"
fi
kver=${kpkg#linux-image-}

build_kernel() { # $1: output dir
	local out=$1 tmp
	tmp=$(mktemp -d "$cache/.kernel.XXXXXX")
	log "downloading $kpkg=$kversion"
	(cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$kpkg=$kversion" >&2)
	log "extracting $(ls "$tmp"/*.deb)"
	mkdir -p "$tmp/x"
	dpkg-deb -x "$tmp"/*.deb "$tmp/x"
	mkdir -p "$tmp/out/lib"
	cp "$tmp/x/boot/vmlinuz-$kver" "$tmp/out/vmlinuz"
	# Debian 13's packages ship the modules under /usr (merged /usr).
	if [ -d "$tmp/x/usr/lib/modules" ]; then
		mv "$tmp/x/usr/lib/modules" "$tmp/out/lib/modules"
	else
		mv "$tmp/x/lib/modules" "$tmp/out/lib/modules"
	fi
	depmod -b "$tmp/out" "$kver"
	rm -rf "$tmp/x" "$tmp"/*.deb
	mv "$tmp/out" "$out"
	rmdir "$tmp"
}
# build_split_kernel DIR: build_kernel for a kernel split into the packages
# $kparts (linux-binary-*, linux-modules-*) and linux-base-*, all at the
# image's version. 7.3.4 cloud: nvme_core, nvme_auth and nvme_keyring are
# built in (CONFIG_NVME_MULTIPATH=y); nvmet, nvmet_tcp, nvme_fabrics,
# nvme_tcp and configfs are the modules of NVMe/TCP on both sides (the
# closure of nvmet nvmet_tcp nvme_tcp, modprobe -d -a --show-depends).
# 36.5 MB to download, ~3 s to unpack, 40 MB unpacked.
build_split_kernel() {
	local out=$1 tmp deb debs=("linux-base-$kver=$kversion")
	tmp=$(mktemp -d "$cache/.kernel.XXXXXX")
	for deb in $kparts; do debs+=("$deb=$kversion"); done
	log "downloading ${debs[*]}"
	(cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "${debs[@]}" >&2)
	mkdir -p "$tmp/x" "$tmp/out/lib"
	for deb in "$tmp"/*.deb; do
		log "extracting $deb"
		dpkg-deb -x "$deb" "$tmp/x"
	done
	# linux-binary has the kernel in the modules directory, not in /boot.
	mv "$tmp/x/usr/lib/modules/$kver/vmlinuz" "$tmp/out/vmlinuz"
	mv "$tmp/x/usr/lib/modules" "$tmp/out/lib/modules"
	depmod -b "$tmp/out" "$kver"
	rm -rf "$tmp/x" "$tmp"/*.deb
	mv "$tmp/out" "$out"
	rmdir "$tmp"
}
kernel_build=build_kernel
[ -z "$kparts" ] || kernel_build=build_split_kernel
kernel_key=$( { declare -f "$kernel_build"; echo "$kpkg=$kversion"; } | sha)
kernel_dir=$stages/kernel-$kernel_key
if [ -d "$kernel_dir" ]; then
	log "kernel $kver ($kversion) cached in $kernel_dir"
else
	t0=$SECONDS
	"$kernel_build" "$kernel_dir"
	log "kernel $kver ready in $((SECONDS - t0)) s"
fi
# NVMe in-band authentication, where the kernel has it as modules (it is
# built in where the kernel has it at all in Debian 13's cloud kernel).
for m in nvme_auth nvme_keyring; do
	modprobe -d "$kernel_dir" -S "$kver" --show-depends "$m" >/dev/null 2>&1 && modules+=("$m")
done

# ---- the other suite's handshake daemon ---------------------------------------
# NVMe/TCP with TLS needs tlshd (ktls-utils), which Debian 13 has and Debian 12
# has not. For an image with another suite's kernel, the package and its library
# closure (glibc, gnutls, glib, libnl, keyutils...) of that suite are downloaded
# through the same private apt configuration as the kernel, resolved against an
# empty dpkg status (so nothing of the host counts as installed), and extracted
# into a tree of their own that the initramfs carries under /opt/<suite>; the
# guest runs tlshd through that suite's own dynamic loader (/usr/sbin/tlshd is a
# wrapper). Nothing of it mixes with the Debian 12 root's libraries.
# nvme-cli of that suite too, as nvme-<suite>: Debian 12's 2.3 cannot insert TLS
# keys (check-tls-key --insert), which the tests compare berth's derivation with.
userland_packages=(ktls-utils nvme-cli)
build_userland() { # $1: output dir
	local out=$1 tmp d
	tmp=$(mktemp -d "$cache/.userland.XXXXXX")
	: >"$tmp/status"
	mkdir -p "$tmp/archives/partial" "$tmp/tree"
	log "downloading ${userland_packages[*]} and their libraries ($ksuite)"
	apt-get install -q -y --download-only --no-install-recommends \
		-o Dir::State::status="$tmp/status" -o Dir::Cache::archives="$tmp/archives" \
		"${userland_packages[@]}" >&2
	for d in "$tmp"/archives/*.deb; do dpkg-deb -x "$d" "$tmp/tree"; done
	rm -rf "$tmp"/tree/usr/share/{man,doc,locale,info} "$tmp/archives" "$tmp/status"
	for d in tlshd nvme; do
		[ -x "$tmp/tree/usr/sbin/$d" ] || die "no usr/sbin/$d in ${userland_packages[*]} ($ksuite)"
	done
	mv "$tmp/tree" "$out"
	rm -rf "$tmp" # apt's lock files beside the status file
}
# A backports suite's lists hold the backported packages alone: its image
# (the newer kernel's secure channel concatenation needs tlshd too) takes the
# userland of its base suite's image, which build.sh <base suite> made first,
# as make vm-image does.
userland_dir=
if [ "$ksuite" != "$suite" ] && [ "$ksuite" != "${ksuite%-backports}" ]; then
	userland_dir=$(sed -n 's/^USERLAND_DIR=//p' "$cache/current-${ksuite%-backports}/image.env" 2>/dev/null || true)
	[ -n "$userland_dir" ] && [ -d "$userland_dir" ] ||
		die "the $ksuite image takes tlshd and nvme-cli from the ${ksuite%-backports} image: run build.sh ${ksuite%-backports} first"
	log "$ksuite userland: the ${ksuite%-backports} image's, $userland_dir"
elif [ "$ksuite" != "$suite" ]; then
	userland_key=$( { declare -f build_userland; echo "$ksuite ${userland_packages[*]} $lists_stamp"; } | sha)
	userland_dir=$stages/userland-$userland_key
	if [ -d "$userland_dir" ]; then
		log "$ksuite userland cached in $userland_dir"
	else
		t0=$SECONDS
		build_userland "$userland_dir"
		log "$ksuite userland ready in $((SECONDS - t0)) s ($(du -sh "$userland_dir" | cut -f1))"
	fi
fi
# The handshake upcall's TLS record layer.
[ -z "$userland_dir" ] || modules+=(tls)

# ---- Debian root -------------------------------------------------------------
build_root() { # $1: output dir
	local out=$1 tmp
	tmp=$(mktemp -d "$cache/.root.XXXXXX")
	log "mmdebstrap $suite (variant essential) with: ${packages[*]}"
	mmdebstrap --quiet --variant=essential --mode=root \
		--include="$(IFS=,; echo "${packages[*]}")" \
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
		"$suite" "$tmp/tree" "$sources" >&2
	guest_config "$tmp/tree"
	echo berth-guest >"$tmp/tree/etc/hostname"
	: >"$tmp/tree/etc/machine-id"
	# The root as a disk image for guests that boot systemd (used as a snapshot).
	log "packing root.ext4"
	mkfs.ext4 -q -F -L berth-root -d "$tmp/tree" "$tmp/root.ext4" 1G
	mv "$tmp" "$out"
}
# guest_config DIR: configuration files of the initiator tools.
guest_config() {
	mkdir -p "$1/etc/iscsi" "$1/var/lib/iscsi"
	echo 'InitiatorName=iqn.2004-10.com.example:guest' >"$1/etc/iscsi/initiatorname.iscsi"
	printf 'defaults {\n\tuser_friendly_names no\n\tfind_multipaths no\n}\n' >"$1/etc/multipath.conf"
}
root_key=$( { declare -f build_root guest_config; echo "$suite ${packages[*]}"; cat "$sources"; } | sha)
root_dir=$stages/root-$root_key
root_tree=$root_dir/tree
if [ -d "$root_dir" ]; then
	log "Debian root cached in $root_dir"
else
	t0=$SECONDS
	build_root "$root_dir"
	log "Debian root ready in $((SECONDS - t0)) s ($(du -sh "$root_dir" | cut -f1))"
fi

# ---- initramfs base and root disk image --------------------------------------
# copy_with_libs ROOT DEST PATH: copies PATH from ROOT to DEST with its shared libraries.
copy_with_libs() {
	local root=$1 dest=$2 path=$3 real lib
	[ -e "$root$path" ] || [ -L "$root$path" ] || { log "warning: $path not in the Debian root"; return 0; }
	mkdir -p "$dest$(dirname "$path")"
	if [ -L "$root$path" ]; then
		cp -a "$root$path" "$dest$path"
		real=$(readlink "$root$path")
		case $real in /*) ;; *) real=$(dirname "$path")/$real ;; esac
		copy_with_libs "$root" "$dest" "$(realpath -m "$real")"
		return 0
	fi
	cp -a "$root$path" "$dest$path"
	# ldd of the root's binary, run inside the root so its own loader and libraries answer.
	for lib in $(chroot "$root" /usr/bin/ldd "$path" 2>/dev/null |
		sed -n 's/.*=> \(\/[^ ]*\).*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (.*/\1/p'); do
		[ -e "$dest$lib" ] && continue
		copy_with_libs "$root" "$dest" "$lib"
	done
}

build_image() { # $1: output dir
	local out=$1 tmp ir m
	tmp=$(mktemp -d "$cache/.image.XXXXXX")
	ir=$tmp/initramfs
	mkdir -p "$ir"/{usr/bin,usr/sbin,usr/lib,usr/lib64,etc,proc,sys,dev,run,tmp,root,var/lib,mnt}
	ln -s usr/bin "$ir/bin"; ln -s usr/sbin "$ir/sbin"; ln -s usr/lib "$ir/lib"; ln -s usr/lib64 "$ir/lib64"
	ln -s /run "$ir/var/run"
	log "copying ${#tools[@]} tools and their libraries"
	for t in "${tools[@]}"; do copy_with_libs "$root_tree" "$ir" "$t"; done
	# Libraries loaded at run time (NSS for iscsid's peer check, libgcc_s for
	# pthread_cancel in multipathd, multipath checkers and prioritizers).
	for m in "$root_tree"/usr/lib/x86_64-linux-gnu/libnss_files.so* \
		"$root_tree"/usr/lib/x86_64-linux-gnu/libgcc_s.so* \
		"$root_tree"/usr/lib/multipath/*.so; do
		[ -e "$m" ] && copy_with_libs "$root_tree" "$ir" "${m#"$root_tree"}"
	done
	# udev rules and helpers, iscsi and multipath configuration.
	cp -a "$root_tree/usr/lib/udev/rules.d" "$ir/usr/lib/udev/" 2>/dev/null || true
	mkdir -p "$ir/etc/udev" "$ir/etc/iscsi" "$ir/var/lib/iscsi"
	cp -a "$root_tree/etc/udev/udev.conf" "$ir/etc/udev/" 2>/dev/null || true
	cp -a "$root_tree/etc/iscsi/iscsid.conf" "$ir/etc/iscsi/"
	# Busybox applets only where no real tool was copied.
	cp /bin/busybox "$ir/usr/bin/busybox"
	/bin/busybox --list-full | while read -r a; do
		case $a in bin/* | sbin/* | usr/bin/* | usr/sbin/*) ;; *) continue ;; esac
		a=${a#usr/}
		[ -e "$ir/usr/$a" ] || [ -L "$ir/usr/$a" ] || ln -s /usr/bin/busybox "$ir/usr/$a"
	done
	# Kernel modules: the closure of the list above, with the module index.
	log "copying kernel modules"
	local kdir=$kernel_dir/lib/modules/$kver
	mkdir -p "$ir/usr/lib/modules/$kver"
	for m in $(modprobe -d "$kernel_dir" -S "$kver" -a --show-depends "${modules[@]}" 2>/dev/null |
		awk '$1 == "insmod" {print $2}' | sort -u); do
		m=${m#"$kernel_dir"}
		m=${m#/usr}
		mkdir -p "$ir/usr$(dirname "$m")"
		cp "$kernel_dir$m" "$ir/usr$m"
	done
	cp "$kdir"/modules.order "$kdir"/modules.builtin* "$ir/usr/lib/modules/$kver/"
	depmod -b "$ir/usr" "$kver"
	# Identity files the tools expect.
	printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$ir/etc/passwd"
	printf 'root:x:0:\ndisk:x:6:\nnogroup:x:65534:\n' >"$ir/etc/group"
	printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files\n' >"$ir/etc/nsswitch.conf"
	printf '127.0.0.1 localhost\n' >"$ir/etc/hosts"
	guest_config "$ir"
	if [ -n "$userland_dir" ]; then
		# The two programs and the libraries the suite's loader resolves
		# for them (its --list loads, never runs, them).
		# Named after the suite the userland is of (trixie for
		# trixie-backports too).
		local usuite=${ksuite%-backports}
		local opt=$ir/opt/$usuite lib=usr/lib/x86_64-linux-gnu w
		mkdir -p "$opt/usr/sbin" "$opt/usr/lib64" "$opt/$lib"
		cp -L "$userland_dir/usr/lib64/ld-linux-x86-64.so.2" "$opt/usr/lib64/"
		for w in tlshd nvme; do
			cp -L "$userland_dir/usr/sbin/$w" "$opt/usr/sbin/"
			"$userland_dir/usr/lib64/ld-linux-x86-64.so.2" --library-path "$userland_dir/$lib" --list "$userland_dir/usr/sbin/$w" |
				sed -n 's/^[[:space:]]*\([^ ]*\) => \(\/[^ ]*\) .*/\1 \2/p' |
				while read -r soname path; do case $soname in /*) ;; *) cp -L "$path" "$opt/$lib/$soname" ;; esac; done
		done
		# tlshd reads its keyrings from /etc/tlshd.conf: the PSKs of
		# NVMe/TCP are in the kernel's .nvme keyring.
		printf '[debug]\nloglevel=0\ntls=0\nnl=0\n\n[authenticate]\nkeyrings=.nvme\n' >"$ir/etc/tlshd.conf"
		for w in tlshd:tlshd nvme:nvme-$usuite; do
			printf '#!/bin/sh\n# %s of Debian %s, run with that suite'"'"'s loader and libraries.\nexec /opt/%s/usr/lib64/ld-linux-x86-64.so.2 --library-path /opt/%s/usr/lib/x86_64-linux-gnu /opt/%s/usr/sbin/%s "$@"\n' \
				"${w%%:*}" "$usuite" "$usuite" "$usuite" "$usuite" "${w%%:*}" >"$ir/usr/sbin/${w#*:}"
			chmod 755 "$ir/usr/sbin/${w#*:}"
		done
	fi
	mkdir -p "$out.tmp"
	log "packing base.cpio.gz"
	(cd "$ir" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) | gzip -1 >"$out.tmp/base.cpio.gz"
	cp "$kernel_dir/vmlinuz" "$out.tmp/vmlinuz"
	cat >"$out.tmp/image.env" <<EOF
KERNEL_VERSION=$kver
KERNEL_PACKAGE=$kpkg=$kversion
KERNEL=$out/vmlinuz
BASE_INITRAMFS=$out/base.cpio.gz
KERNEL_DIR=$kernel_dir
KERNEL_ARGS=$kernel_args
ROOT_DISK=$root_dir/root.ext4
ROOT_DIR=$root_tree
USERLAND_DIR=$userland_dir
EOF
	rm -rf "$tmp"
	mv "$out.tmp" "$out"
}
image_key=$( { declare -f build_image copy_with_libs guest_config; echo "${tools[*]} ${modules[*]} $kernel_args $kernel_key $root_key $userland_dir"; } | sha)
image_dir=$stages/image-$image_key
if [ -d "$image_dir" ]; then
	touch "$image_dir" "$kernel_dir" "$root_dir"
	log "image cached in $image_dir"
else
	t0=$SECONDS
	rm -rf "$image_dir.tmp"
	build_image "$image_dir"
	log "image ready in $((SECONDS - t0)) s ($(du -sh --apparent-size "$image_dir/base.cpio.gz" | cut -f1) initramfs)"
fi
touch "$image_dir" "$kernel_dir" "$root_dir"
link=current
[ "$ksuite" = "$suite" ] || link=current-$ksuite
ln -sfn "stages/image-$image_key" "$cache/$link.tmp"
mv -T "$cache/$link.tmp" "$cache/$link"

# Drop stages no longer referenced, once no test started an hour ago can still use them.
# The stages of every current link (the images of other suites' kernels) stay.
keep=("$kernel_dir" "$root_dir" "$image_dir" ${userland_dir:+"$userland_dir"})
for l in "$cache"/current "$cache"/current-*; do
	[ -f "$l/image.env" ] || continue
	keep+=("$cache/$(readlink "$l")")
	keep+=($(sed -n 's/^KERNEL_DIR=//p; s/^ROOT_DIR=\(.*\)\/tree$/\1/p; s/^USERLAND_DIR=\(..*\)$/\1/p' "$l/image.env"))
done
for d in "$stages"/kernel-* "$stages"/root-* "$stages"/image-* "$stages"/userland-*; do
	[ -d "$d" ] || continue
	case " ${keep[*]} " in *" $d "*) continue ;; esac
	[ -n "$(find "$d" -maxdepth 0 -mmin +60)" ] || continue
	log "removing stale $d"
	rm -rf "$d"
done
echo "$image_dir"
