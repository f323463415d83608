#!/usr/bin/env bash
# Installs the Debian packages berth's build, tests and VM suite use.
# Idempotent: packages already present are not reinstalled.
set -euo pipefail

pkgs=()
need() { for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || pkgs+=("$p"); done; }

need git make curl unzip ca-certificates # the quick start: clone, make, fetch Go
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
	[ "$status" = 0 ] || exit $status
fi

# The Go toolchain go.mod asks for, in /usr/local/go: Debian's golang
# package is older. It comes from the Go module proxy (the module
# golang.org/toolchain, which Go's own GOTOOLCHAIN=auto fetches), over HTTPS.
want=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$(dirname "$0")/../go.mod")
have=$(/usr/local/go/bin/go env GOVERSION 2>/dev/null | sed 's/^go//') || have=
if [ "$(printf '%s\n%s\n' "$want" "${have:-0}" | sort -V | head -1)" != "$want" ]; then
	arch=$(dpkg --print-architecture)
	proxy=${GOPROXY:-https://proxy.golang.org}
	proxy=${proxy%%,*}
	zip=$(mktemp --suffix=.zip)
	trap 'rm -f "$zip"' EXIT
	echo "install-deps: Go $want into /usr/local/go (found: ${have:-none}), from $proxy"
	curl -fsSL -o "$zip" "$proxy/golang.org/toolchain/@v/v0.0.1-go$want.linux-$arch.zip"
	tmp=$(mktemp -d)
	unzip -q "$zip" -d "$tmp"
	rm -rf /usr/local/go
	mv "$tmp/golang.org/toolchain@v0.0.1-go$want.linux-$arch" /usr/local/go
	rm -rf "$tmp"
	/usr/local/go/bin/go version
fi
case ":$PATH:" in
*:/usr/local/go/bin:*) ;;
*) echo "install-deps: add Go to your PATH: export PATH=/usr/local/go/bin:\$PATH" ;;
esac
