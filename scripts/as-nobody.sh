#!/bin/sh
# as-nobody.sh TEST_BINARY [ARGS...]: go test -exec wrapper that runs a
# test binary as an unprivileged user (CHECK_USER, default 65534), so
# that a root shell runs the tests the way a contributor without root
# does: every test that needs root skips by its own euid check. The
# binary is copied out of go's build directory, which only root can
# enter, so that tests that run it again as a child can.
set -eu
uid=${CHECK_USER:-65534}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp "$1" "$dir/"
chmod 0755 "$dir"
bin=$dir/$(basename "$1")
shift
status=0
setpriv --reuid="$uid" --regid="$uid" --clear-groups "$bin" "$@" || status=$?
exit "$status"
