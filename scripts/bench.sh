#!/usr/bin/env bash
# make bench: the speed figures, each measured side by side in one run.
#
# The host benchmarks run first: Go benchmarks of the agent and fs, then
# test/bench (concurrent stages against the same raw steps at once, and the
# Node RPCs with 10 against 10,000 mounts in a private mount namespace).
# Then every guest benchmark runs inside a QEMU guest (real nvmet and LIO
# targets on loopback) through its package's TestVMBench* entry point. The
# test/bench and guest benchmarks only run when BERTH_BENCH=1; the tables
# they print (lines marked "BENCH") are collected into one report. Both
# run twice: on the host as it is, then with two CPU-bound loops beside.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${BERTH_BENCH_OUT:-bench-results.txt}
log=$(mktemp)
hostlog=$(mktemp)
alllog=$(mktemp)
trap 'rm -f "$log" "$hostlog" "$alllog"' EXIT

echo "berth bench: $(git describe --always --dirty 2>/dev/null || echo dev), $(date -u +%FT%TZ), $(nproc) cores" | tee "$out"

# Host benchmarks on loop devices: the agent's RPC paths and the fs hot path.
echo "== host: agent and fs (loop devices)" | tee -a "$out"
go test -count=1 -run '^$' -bench . -benchmem ./agent/ ./fs/ 2>&1 | grep -E '^(Benchmark|ok|FAIL|---)' | tee -a "$out"

# busy runs its arguments with two CPU-bound loops beside them: a node
# is rarely idle, and every goal must hold on a busy one too.
busy() {
	local pids=() rc=0
	for _ in 1 2; do
		(while :; do :; done) &
		pids+=($!)
	done
	"$@" || rc=$?
	kill "${pids[@]}" 2>/dev/null || true
	wait "${pids[@]}" 2>/dev/null || true
	return "$rc"
}

# host_bench LABEL runs test/bench; guest_bench LABEL the guests' benches.
# Lines the benchmarks mark with "BENCH " are the report.
host_bench() {
	echo "== host, $1: concurrent stages vs raw steps; Node RPCs with 10 vs 10,000 mounts" | tee -a "$out"
	BERTH_BENCH=1 go test -count=1 -timeout 30m -run '^TestBench' -v ./test/bench/ 2>&1 | tee "$hostlog" | grep -E '^(---|ok|FAIL|PASS)' || true
	grep -h 'BENCH ' "$hostlog" | sed 's/.*BENCH //' | tee -a "$out"
	cat "$hostlog" >>"$alllog"
}
guest_bench() {
	echo "== guests, $1: NVMe/TCP, iSCSI and device discovery" | tee -a "$out"
	# One package at a time: two guests at once would share the host's cores.
	BERTH_BENCH=1 go test -p 1 -count=1 -timeout 30m -run '^TestVMBench' -v ./... 2>&1 | tee "$log" | grep -E '^(---|ok|FAIL|PASS)' || true
	# A takeover against a normal stage needs two nodes and a target:
	# the fencing guests' filesystem case, whose free stages are
	# measured three times with BERTH_BENCH=1.
	BERTH_BENCH=1 BERTH_FENCE_CASES=fs go test -count=1 -timeout 30m -run '^TestVMFencing$' -v ./iscsi/ 2>&1 | tee -a "$log" | grep -E '^(---|ok|FAIL|PASS)' || true
	grep -h 'BENCH ' "$log" | sed 's/.*BENCH //' | tee -a "$out"
	cat "$log" >>"$alllog"
}

host_bench idle
busy host_bench "busy (two CPU-bound loops beside)"
guest_bench idle
busy guest_bench "busy (two CPU-bound loops beside)"

if grep -q '^--- FAIL' "$alllog" || grep -q '^FAIL' "$alllog"; then
	echo "bench: a benchmark failed; see the go test output above" >&2
	exit 1
fi
echo "report written to $out"
