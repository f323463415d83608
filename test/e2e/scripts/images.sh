#!/bin/bash
# Writes the images the e2e cluster runs as docker archives in
# $E2E_CACHE/images, for ctr images import: there is no registry. Names and
# tags are the ones Kubernetes v1.34.4's storage tests use
# (test/utils/image/manifest.go) and the DaemonSet's livenessprobe; the
# kubelet finds them locally (IfNotPresent, no tag is latest).
#   pause            the static pause of test/e2e/pause
#   busybox, nginx   busybox-static with its applet links
#   agnhost          agnhost over the busybox tree
#   jessie-dnsutils  a Debian root (mmdebstrap minbase): multiVolume's dd
#                    uses oflag=nocache, which busybox dd refuses
#   livenessprobe    test/e2e/livenessprobe, under the sidecar's name
#   csi-attacher     the external-attacher build.sh builds (v4.13.0), for
#                    the berth-controller Deployment
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/../.." && pwd)
GO=${GO:-go}
E2E_CACHE=${E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-e2e}
bin=$E2E_CACHE/bin out=$E2E_CACHE/images work=$E2E_CACHE/rootfs
mkdir -p "$out" "$work"
mkimage=$E2E_CACHE/bin/mkimage
(cd "$repo" && CGO_ENABLED=0 "$GO" build -o "$mkimage" ./scripts/mkimage)

# image FILE NAME TAG ROOT ENTRYPOINT CMD [ADD...]
image() {
	local file=$1 name=$2 tag=$3 root=$4 entry=$5 cmd=$6
	shift 6
	local adds=() a
	for a in "$@"; do adds+=(-add "$a"); done
	"$mkimage" -root "$root" "${adds[@]}" -name "$name" -tag "$tag" \
		-entrypoint "$entry" -cmd "$cmd" -epoch 0 -o "$out/$file.tar" >/dev/null
}

empty=$work/empty
mkdir -p "$empty"

# busybox: the static binary and one link per applet.
bb=$work/busybox
if [ ! -x "$bb/bin/busybox" ]; then
	rm -rf "$bb.tmp" && mkdir -p "$bb.tmp"/{bin,etc,tmp,root}
	cp /bin/busybox "$bb.tmp/bin/busybox"
	for a in $("$bb.tmp/bin/busybox" --list); do
		[ "$a" = busybox ] || ln -s busybox "$bb.tmp/bin/$a"
	done
	chmod 1777 "$bb.tmp/tmp"
	printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$bb.tmp/etc/passwd"
	printf 'root:x:0:\nnogroup:x:65534:\n' > "$bb.tmp/etc/group"
	rm -rf "$bb" && mv "$bb.tmp" "$bb"
fi

# jessie-dnsutils: a Debian root, cached by suite.
. /etc/os-release
deb=$work/debian-$VERSION_CODENAME
if [ ! -d "$deb" ]; then
	rm -rf "$deb.tmp"
	mmdebstrap --quiet --variant=minbase --mode=root "$VERSION_CODENAME" "$deb.tmp" >&2
	# Device nodes are the runtime's to make; an image holds none.
	rm -rf "$deb.tmp"/var/cache/apt/* "$deb.tmp"/var/lib/apt/lists/* "$deb.tmp"/dev/*
	mv "$deb.tmp" "$deb"
fi

image pause registry.k8s.io/pause 3.10.1 "$empty" /pause "" "$bin/pause:/pause:0755"
image busybox registry.k8s.io/e2e-test-images/busybox 1.37.0-1 "$bb" "" /bin/sh
image nginx registry.k8s.io/e2e-test-images/nginx 1.14-4 "$bb" "" /bin/sh
image agnhost registry.k8s.io/e2e-test-images/agnhost 2.56 "$bb" /agnhost pause "$bin/agnhost:/agnhost:0755"
image jessie-dnsutils registry.k8s.io/e2e-test-images/jessie-dnsutils 1.7 "$deb" "" /bin/sh
image livenessprobe registry.k8s.io/sig-storage/livenessprobe v2.15.0 "$empty" /livenessprobe "" "$bin/livenessprobe:/livenessprobe:0755"
image csi-attacher registry.k8s.io/sig-storage/csi-attacher v4.13.0 "$empty" /csi-attacher "" "$bin/csi-attacher:/csi-attacher:0755"
ls -s --block-size=M "$out"
