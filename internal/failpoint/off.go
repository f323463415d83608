//go:build !failpoints

package failpoint

// Hit marks a step boundary; see the package documentation.
func Hit(name string) {}

// Enabled reports whether this build has failpoints.
const Enabled = false
