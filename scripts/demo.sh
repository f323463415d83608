#!/usr/bin/env bash
# berth demo: serve the berth binary on a temporary socket and take a
# file-backed volume through the CSI node lifecycle with a real CSI gRPC
# client (test/democlient): stage, publish, write, expand, unpublish,
# unstage, stage again with the data intact. Every step prints its result
# and its time. Needs root (loop devices, mounts); `make demo` builds
# bin/berth first.
set -euo pipefail

cd "$(dirname "$0")/.."
BIN=${BERTH_BIN:-bin/berth}
FS_TYPE=${BERTH_DEMO_FS:-xfs}   # ext4 online grow needs CAP_SYS_RESOURCE

if [ "$(id -u)" -ne 0 ]; then
	echo "demo: needs root (loop devices and mounts)" >&2
	exit 1
fi
if [ ! -x "$BIN" ]; then
	echo "demo: $BIN not built; run make demo" >&2
	exit 1
fi

work=$(mktemp -d /tmp/berth-demo.XXXXXX)
berth_pid=
cleanup() {
	status=$?
	if [ -n "$berth_pid" ]; then
		kill -TERM "$berth_pid" 2>/dev/null || true
		wait "$berth_pid" 2>/dev/null || true
	fi
	# After a failed step, leave nothing mounted or attached behind.
	for m in "$work/vol/pod/volume" "$work/vol/staging"; do
		if mountpoint -q "$m" 2>/dev/null; then umount "$m" || true; fi
	done
	if command -v losetup >/dev/null; then
		losetup -j "$work/images/demo.img" -O NAME -n 2>/dev/null | while read -r dev; do losetup -d "$dev" || true; done
	fi
	if [ $status -ne 0 ] && [ -f "$work/berth.log" ]; then
		echo "--- berth log ---" >&2
		cat "$work/berth.log" >&2
	fi
	rm -rf "$work"
	exit $status
}
trap cleanup EXIT

echo "== building the demo client"
go build -o "$work/democlient" ./test/democlient

mkdir -p "$work/images" "$work/state" "$work/vol"
truncate -s 300M "$work/images/demo.img"   # sparse; xfs needs >= 300 MiB

echo "== starting $("$BIN" version | head -1 | sed 's/^/berth /') on unix://$work/csi.sock"
"$BIN" serve \
	--endpoint "unix://$work/csi.sock" \
	--node-id demo-node \
	--state-dir "$work/state" \
	--file-root "$work/images" \
	--log-format text 2>"$work/berth.log" &
berth_pid=$!

echo "== file transport (loop device)"
"$work/democlient" \
	-endpoint "unix://$work/csi.sock" \
	-image demo.img \
	-image-path "$work/images/demo.img" \
	-work "$work/vol" \
	-fs-type "$FS_TYPE" \
	-grow-to $((600 << 20))

# NVMe/TCP and iSCSI steps go here: they need targets, which only the
# QEMU guests of test/vm provide (make vm-image). Each runs the same
# client against berth inside a guest with volume_context for its
# transport, e.g. -context nqn=...,targetTrAddr=... .

echo "== stopping berth (SIGTERM)"
kill -TERM "$berth_pid"
wait "$berth_pid"
berth_pid=
echo "demo: done"
