package fs

import (
	"bytes"
	"context"
	"fmt"
	"io"

	"golang.org/x/sys/unix"
)

// FilesystemUUID returns the UUID of the fsType filesystem on devPath,
// read from its superblock (bypassing the buffer cache) as blkid prints
// it.
func FilesystemUUID(devPath, fsType string) (string, error) {
	f, err := openDirect(devPath)
	if err != nil {
		return "", fmt.Errorf("read filesystem UUID of %s: %w", devPath, err)
	}
	defer f.Close()
	const blockSize = 4096
	buf, err := alignedBuffer(blockSize)
	if err != nil {
		return "", fmt.Errorf("read filesystem UUID of %s: %w", devPath, err)
	}
	defer unix.Munmap(buf)
	n, err := readAtFull(context.Background(), f, buf, 0)
	if err != nil {
		return "", fmt.Errorf("read filesystem UUID of %s: %w", devPath, err)
	}
	uuid, err := filesystemUUID(bytes.NewReader(buf[:n]), fsType)
	if err != nil {
		return "", fmt.Errorf("read filesystem UUID of %s: %w", devPath, err)
	}
	return uuid, nil
}

// Where ext4 and xfs keep their UUID: ext2/3/4 s_uuid at byte 104 of
// the superblock that starts at 1024; xfs sb_uuid at byte 32 of the
// primary superblock at 0.
const (
	ext4UUIDOffset = 1024 + 104
	xfsUUIDOffset  = 32
	uuidLen        = 16
)

// filesystemUUID reads the UUID of the fsType superblock at the start of
// r, formatted as blkid prints it (lower-case 8-4-4-4-12). A device
// without that superblock is an error.
func filesystemUUID(r io.ReaderAt, fsType string) (string, error) {
	var magic []byte
	var magicOff, uuidOff int64
	switch fsType {
	case Ext4:
		magic, magicOff, uuidOff = ext4Magic, ext4MagicOffset, ext4UUIDOffset
	case XFS:
		magic, magicOff, uuidOff = xfsMagic, xfsMagicOffset, xfsUUIDOffset
	default:
		return "", checkFsType(fsType)
	}
	m := make([]byte, len(magic))
	if _, err := r.ReadAt(m, magicOff); err != nil {
		return "", fmt.Errorf("read the %s superblock: %w", fsType, err)
	}
	if !bytes.Equal(m, magic) {
		return "", fmt.Errorf("no %s superblock", fsType)
	}
	u := make([]byte, uuidLen)
	if _, err := r.ReadAt(u, uuidOff); err != nil {
		return "", fmt.Errorf("read the %s superblock: %w", fsType, err)
	}
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]), nil
}
