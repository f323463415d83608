// Package failpoint marks the step boundaries of berth's operations, so
// that a test can kill the agent at each of them and prove that a retry
// converges.
//
// In a normal build Hit does nothing and costs nothing. Built with the tag
// "failpoints", Hit counts the boundaries a process passes and, driven by
// two environment variables:
//
//   - BERTH_FAILPOINT_TRACE=file appends one line per boundary passed,
//     "N name", N counting from 1;
//   - BERTH_FAILPOINT_AT=N sends SIGKILL to the process itself at the Nth
//     boundary, before the step after it starts.
//
// A test traces an operation once, then reruns it killing the agent at
// each traced boundary in turn: every boundary is covered, none sampled.
package failpoint
