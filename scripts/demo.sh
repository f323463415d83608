#!/usr/bin/env bash
# berth demo: serve the berth binary on a temporary socket and take a
# file-backed volume through the CSI node lifecycle with a real CSI gRPC
# client (test/democlient): stage, publish, write, expand, unpublish,
# unstage, stage again with the data intact. Then boot a QEMU guest
# (test/vm) where berth serves CSI next to the kernel's own NVMe/TCP and
# iSCSI targets, and take an NVMe/TCP volume and an iSCSI volume with CHAP
# through the same steps (test/demo). Every step prints its result and its
# time, and every result is checked: the demo fails when berth misbehaves
# or when the guest cannot be prepared. Needs root (loop devices, mounts,
# the guest image); `make demo` builds bin/berth first.
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

echo "== stopping berth (SIGTERM)"
kill -TERM "$berth_pid"
wait "$berth_pid"
berth_pid=
rm -f "$work/berth.log" # a later failure is not the host berth's

echo
echo "== NVMe/TCP and iSCSI in a QEMU guest: berth serves CSI inside it, nvmet and LIO export the volumes"
if ! command -v qemu-system-x86_64 >/dev/null; then
	echo "demo: qemu-system-x86_64 not found: run make deps" >&2
	exit 1
fi
echo "== guest image (test/vm/image/build.sh; cached after the first build)"
if ! ./test/vm/image/build.sh >/dev/null; then
	echo "demo: the guest image could not be built (see above; make vm-image retries)" >&2
	exit 1
fi
echo "== building the guest test binary, booting the guest (TCG) and running both volumes"
# BERTH_CI=1: a guest that cannot boot fails the demo instead of skipping.
# The step lines carry the marker "DEMO| "; the full go test output is kept
# for a failure.
vmlog="$work/vm-test.log"
if ! BERTH_CI=1 BERTH_DEMO=1 go test -count=1 -v -timeout 10m -run '^TestDemoVM$' ./test/demo/ 2>&1 |
	tee "$vmlog" |
	sed -un -e 's/^.*DEMO| //p' \
		-e 's/^.*vm demo: built test binary and initramfs in \(.*\)$/   (guest initramfs built in \1; guest running)/p'; then
	keep=${TMPDIR:-/tmp}/berth-demo-vm.log
	cp "$vmlog" "$keep"
	echo "--- end of the VM test output (all of it: $keep) ---" >&2
	tail -n 60 "$vmlog" >&2
	echo "demo: the VM part failed" >&2
	exit 1
fi
echo "demo: done"
