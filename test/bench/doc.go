// Package bench holds berth's host benchmarks that compare the agent with
// the kernel steps it wraps, measured side by side in one run: N volumes
// staged at once against the same N losetup, mkfs and mount run at once,
// and the Node RPCs on a node with 10 against 10,000 unrelated mounts
// (in a private mount namespace). They run only with BERTH_BENCH=1 (make
// bench) and as root; their results are the lines marked "BENCH".
package bench
