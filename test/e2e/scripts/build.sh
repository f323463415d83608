#!/bin/bash
# Builds everything make e2e runs, into $E2E_CACHE (default
# ~/.cache/berth-e2e; Go's build cache keeps the objects, so a second run
# links or skips):
#   bin/     kube-apiserver, kube-controller-manager, kube-scheduler,
#            kubelet, kubectl, agnhost, e2e.test (build-k8s.sh);
#            csi-provisioner, csi-resizer, csi-attacher (their own wrapper
#            modules);
#            csicontroller, livenessprobe, pause (this directory's programs)
#   images/  the test images as docker archives (images.sh)
# berth's image is make image's (bin/berth-image.tar), built by the Makefile.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/../.." && pwd)
GO=${GO:-go}
export E2E_CACHE=${E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-e2e}
bin=$E2E_CACHE/bin
mkdir -p "$bin"
export CGO_ENABLED=0

t0=$(date +%s)
GO=$GO "$here/scripts/build-k8s.sh"

# The sidecars, each in its own module; skipped when the module is unchanged.
for s in provisioner:github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner \
	resizer:github.com/kubernetes-csi/external-resizer/cmd/csi-resizer \
	attacher:github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher; do
	dir=${s%%:*} pkg=${s#*:} out=$bin/$(basename "$pkg")
	stamp=$(cat "$here/$dir/go.mod" "$here/$dir/go.sum" | sha256sum | cut -c1-16)
	if [ -x "$out" ] && [ "$(cat "$out.stamp" 2>/dev/null)" = "$stamp" ]; then
		continue
	fi
	t=$(date +%s)
	(cd "$here/$dir" && "$GO" build -trimpath -ldflags '-s -w' -o "$out" "$pkg")
	echo "$stamp" > "$out.stamp"
	echo "build: $(basename "$pkg") in $(( $(date +%s) - t ))s"
done

# This directory's programs, from berth's module.
(cd "$repo" && "$GO" build -trimpath -ldflags '-s -w' -o "$bin/" \
	./test/e2e/csicontroller ./test/e2e/livenessprobe ./test/e2e/pause ./test/e2e/summary)

"$here/scripts/images.sh"
echo "build: done in $(( $(date +%s) - t0 ))s"
