#!/bin/bash
# make e2e: start the cluster (cluster.sh up), run the external storage
# suite (run.sh), the restart tests (restart.sh) and the two-node tests
# (twonode.sh; E2E_TWONODE=0 leaves them out), tear the cluster down
# whatever happened and check that nothing is left (cluster.sh down, check).
# Exits non-zero when a spec failed, the cluster did not come up, or
# something was left behind.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
t0=$SECONDS
status=0
"$here/cluster.sh" down >/dev/null 2>&1 || true
trap '"$here/cluster.sh" down; "$here/cluster.sh" check || status=1; echo "e2e: $((SECONDS - t0))s in all"; exit $status' EXIT
"$here/cluster.sh" up || { status=1; exit; }
"$here/run.sh" || status=1
if [ "${E2E_RESTART:-1}" != 0 ] && [ -x "$here/restart.sh" ]; then
	"$here/restart.sh" || status=1
fi
# Last: it adds a second node and removes it again.
if [ "${E2E_TWONODE:-1}" != 0 ]; then
	"$here/twonode.sh" || status=1
fi
