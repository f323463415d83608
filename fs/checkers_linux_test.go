package fs

func mountCheckers() map[string]func(string) (bool, error) {
	return map[string]func(string) (bool, error){
		"statx": isMountPointStatx, "openat2": isMountPointOpenat2, "mountinfo": isMountPointMountinfo,
	}
}
