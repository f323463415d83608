#!/usr/bin/env bash
# make bench: the speed figures, each measured side by side in one run.
#
# Every benchmark runs inside a QEMU guest (real nvmet and LIO targets on
# loopback) through its package's TestVMBench* entry point, which only runs
# when BERTH_BENCH=1. The tables they print are collected into one report.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${BERTH_BENCH_OUT:-bench-results.txt}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "berth bench: $(git describe --always --dirty 2>/dev/null || echo dev), $(date -u +%FT%TZ), $(nproc) cores" | tee "$out"

# Host benchmarks on loop devices: the agent's RPC paths and the fs hot path.
echo "== host: agent and fs (loop devices)" | tee -a "$out"
go test -count=1 -run '^$' -bench . -benchmem ./agent/ ./fs/ 2>&1 | grep -E '^(Benchmark|ok|FAIL|---)' | tee -a "$out"

echo "== guests: NVMe/TCP, iSCSI and device discovery" | tee -a "$out"
# One package at a time: two guests at once would share the host's cores.
BERTH_BENCH=1 go test -p 1 -count=1 -timeout 30m -run '^TestVMBench' -v ./... 2>&1 | tee "$log" | grep -E '^(---|ok|FAIL|PASS)' || true

# Lines the benchmarks mark with "BENCH " are the report.
grep -h 'BENCH ' "$log" | sed 's/.*BENCH //' | tee -a "$out"
if grep -q '^--- FAIL' "$log" || grep -q '^FAIL' "$log"; then
	echo "bench: a benchmark failed; see the go test output above" >&2
	exit 1
fi
echo "report written to $out"
