//go:build !linux

package fs

func mountCheckers() map[string]func(string) (bool, error) {
	return map[string]func(string) (bool, error){"IsMountPoint": IsMountPoint}
}
