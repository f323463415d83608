package agent

import (
	"os"
)

func mkdirAll(p string) error { return os.MkdirAll(p, 0o750) }
