#!/usr/bin/env bash
# Builds berth's container image without a container daemon, as an archive
# that `docker load`, `podman load` and `ctr images import` read (docker-save
# manifest.json and an OCI layout in one tar):
#
#   root-<key>/tree   a Debian root holding only what berth runs on a node,
#                     made with mmdebstrap (cached outside the repository,
#                     keyed by the package list, this script and the apt
#                     sources; an unchanged key downloads nothing)
#   OUT               the archive: that root, the static berth binary in
#                     /usr/local/bin and the iscsiadm/multipathd wrappers of
#                     deploy/kubernetes, as one layer; tagged NAME:VERSION
#
# The archive is reproducible: every file's time is SOURCE_DATE_EPOCH
# (default: the commit time of HEAD), entries are sorted, owners numeric, so
# two builds of one commit give the same image digest.
#
# Usage: scripts/image.sh BERTH_BINARY VERSION OUT [NAME]
# Environment: BERTH_IMAGE_CACHE (cache directory), BERTH_IMAGE_APT_SOURCES
# (apt sources file given to mmdebstrap; default: the host's own), GO (the go
# command), SOURCE_DATE_EPOCH.
set -euo pipefail

# chroot, ldconfig and mmdebstrap live in the sbin directories.
export PATH=$PATH:/usr/sbin:/sbin

log() { printf 'image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -ge 3 ] || die "usage: $0 BERTH_BINARY VERSION OUT [NAME]"
bin=$1 version=$2 out=$3 name=${4:-ghcr.io/berth-csi/berth}
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd)
cache=${BERTH_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-image}

[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap --mode=root)"
command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is missing (make deps installs it)"
[ -x "$bin" ] || die "$bin: no berth binary (make build)"
# berth must not need a loader or libraries from the image.
if file "$bin" 2>/dev/null | grep -q 'dynamically linked'; then
	die "$bin is dynamically linked: build it with CGO_ENABLED=0 (make build)"
fi

mkdir -p "$cache"
exec 9>"$cache/.lock"
if ! flock -n 9; then
	log "waiting for another build in $cache"
	flock 9
fi

sources=${BERTH_IMAGE_APT_SOURCES:-}
if [ -z "$sources" ]; then
	if [ -s /etc/apt/sources.list ] && grep -q '^[[:space:]]*deb ' /etc/apt/sources.list; then
		sources=/etc/apt/sources.list
	else
		for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
			[ -f "$f" ] && grep -qi debian "$f" && { sources=$f; break; }
		done
	fi
fi
[ -n "$sources" ] && [ -f "$sources" ] || die "no apt sources file found (set BERTH_IMAGE_APT_SOURCES)"
. /etc/os-release
suite=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}

# What berth execs on a node, and what the wrappers need: mkfs.ext4, e2fsck,
# resize2fs (e2fsprogs); mkfs.xfs, xfs_growfs (xfsprogs); blkid and nsenter
# (util-linux); cryptsetup (cryptsetup-bin); /bin/sh for the wrappers (dash).
# The extract variant unpacks them and their dependencies without running
# maintainer scripts; the image then takes only the programs below, with
# their shared libraries, and the configuration files they read. Packages
# pull in much that berth never runs (xfsprogs brings Python and ICU for
# xfs_scrub; util-linux brings dpkg and debconf). No tlshd: for NVMe/TCP with
# TLS the kernel hands its handshakes to the host's tlshd, as iscsiadm talks
# to the host's iscsid; berth only puts the PSKs into the kernel's keyring.
packages=(e2fsprogs xfsprogs util-linux mount cryptsetup-bin dash libc-bin)
programs=(
	/bin/sh /bin/dash
	/sbin/mke2fs /sbin/mkfs.ext4 /sbin/e2fsck /sbin/fsck.ext4 /sbin/resize2fs /sbin/tune2fs /sbin/dumpe2fs
	/sbin/mkfs.xfs /usr/sbin/xfs_growfs /sbin/xfs_repair /usr/sbin/xfs_db /usr/sbin/xfs_io
	/sbin/blkid /sbin/wipefs /sbin/blockdev /sbin/losetup /usr/bin/nsenter /bin/mount /bin/umount /bin/findmnt /bin/lsblk
	/sbin/cryptsetup
)
config=(/etc/mke2fs.conf /etc/e2scrub.conf)

# copy_closure FROM TO PATH: PATH, the target of a symbolic link, and the
# shared libraries of an executable (listed by the loader of FROM).
copy_closure() {
	local from=$1 to=$2 path=$3 real lib
	[ -e "$to$path" ] || [ -L "$to$path" ] && return 0
	[ -e "$from$path" ] || [ -L "$from$path" ] || die "$path is not in the Debian root"
	mkdir -p "$to$(dirname "$path")"
	cp -a "$from$path" "$to$path"
	if [ -L "$from$path" ]; then
		real=$(readlink "$from$path")
		case $real in /*) ;; *) real=$(dirname "$path")/$real ;; esac
		copy_closure "$from" "$to" "$(realpath -m -s "$real")"
		return 0
	fi
	for lib in $(chroot "$from" /lib64/ld-linux-x86-64.so.2 --list "$path" 2>/dev/null |
		sed -n 's/.*=> \(\/[^ ]*\).*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (.*/\1/p'); do
		copy_closure "$from" "$to" "$lib"
	done
}

build_root() { # $1: output dir
	local out=$1 tmp full t p
	tmp=$(mktemp -d "$cache/.root.XXXXXX")
	full=$tmp/full t=$tmp/tree
	log "mmdebstrap $suite (variant extract) with: ${packages[*]}"
	mmdebstrap --quiet --variant=extract --mode=root \
		--include="$(IFS=,; echo "${packages[*]}")" \
		"$suite" "$full" "$sources" >&2
	chroot "$full" /sbin/ldconfig
	mkdir -p "$t"/{etc,tmp,dev,proc,sys,run,var/lib,usr/local/bin}
	chmod 1777 "$t/tmp"
	for p in "${programs[@]}" "${config[@]}"; do
		copy_closure "$full" "$t" "$p"
	done
	# Identity files (root only), the loader's cache of the copied libraries.
	printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$t/etc/passwd"
	printf 'root:x:0:\ndisk:x:6:\nnogroup:x:65534:\n' >"$t/etc/group"
	printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$t/etc/nsswitch.conf"
	# e2fsprogs read the mount table here to refuse a mounted device.
	ln -s ../proc/self/mounts "$t/etc/mtab"
	ldconfig -r "$t"
	rm -f "$t/var/cache/ldconfig/aux-cache"
	rmdir "$t/var/cache/ldconfig" "$t/var/cache" 2>/dev/null || true
	# Each program starts inside the pruned root with its own loader and
	# libraries.
	chroot "$t" /sbin/mkfs.ext4 -V >/dev/null 2>&1 || die "mkfs.ext4 does not run in the image root"
	chroot "$t" /sbin/e2fsck -V >/dev/null 2>&1 || die "e2fsck does not run in the image root"
	chroot "$t" /sbin/mkfs.xfs -V >/dev/null || die "mkfs.xfs does not run in the image root"
	chroot "$t" /usr/sbin/xfs_growfs -V >/dev/null || die "xfs_growfs does not run in the image root"
	chroot "$t" /sbin/blkid -V >/dev/null || die "blkid does not run in the image root"
	chroot "$t" /sbin/cryptsetup --version >/dev/null || die "cryptsetup does not run in the image root"
	chroot "$t" /bin/sh -c 'exec nsenter --version' >/dev/null || die "sh and nsenter do not run in the image root"
	rm -rf "$full"
	mv "$tmp" "$out"
}
root_key=$( { declare -f build_root copy_closure; echo "$suite ${packages[*]} ${programs[*]} ${config[*]}"; cat "$sources"; } | sha256sum | cut -c1-16)
root_dir=$cache/root-$root_key
if [ -d "$root_dir" ]; then
	log "Debian root cached in $root_dir"
else
	t0=$SECONDS
	build_root "$root_dir"
	log "Debian root ready in $((SECONDS - t0)) s ($(du -sh "$root_dir/tree" | cut -f1))"
fi

epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo_root" log -1 --format=%ct 2>/dev/null || echo 0)}
mkdir -p "$(dirname "$out")"
cd "$repo_root"
CGO_ENABLED=0 "${GO:-go}" run ./scripts/mkimage \
	-root "$root_dir/tree" \
	-add "$bin:/usr/local/bin/berth:0755" \
	-add "deploy/kubernetes/iscsiadm-host:/usr/local/bin/iscsiadm-host:0755" \
	-add "deploy/kubernetes/multipathd-host:/usr/local/bin/multipathd-host:0755" \
	-name "$name" -tag "$version" -epoch "$epoch" -o "$out"
