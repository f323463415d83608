package vm

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// cpioWriter writes a newc ("070701") archive, the format the kernel unpacks
// into its initramfs. Archives concatenate: a later entry replaces an earlier
// one of the same name, so the per-run archive is appended to the cached base.
type cpioWriter struct {
	w    io.Writer
	ino  uint32
	dirs map[string]bool
	err  error
}

func newCPIOWriter(w io.Writer) *cpioWriter {
	return &cpioWriter{w: w, ino: 1 << 20, dirs: map[string]bool{}}
}

func (c *cpioWriter) header(name string, mode uint32, size int) {
	if c.err != nil {
		return
	}
	c.ino++
	name = strings.TrimPrefix(path.Clean("/"+name), "/")
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name)+1, 0)
	buf := append([]byte(hdr), name...)
	buf = append(buf, 0)
	for len(buf)%4 != 0 {
		buf = append(buf, 0)
	}
	_, c.err = c.w.Write(buf)
}

func (c *cpioWriter) pad(n int) {
	if c.err != nil || n%4 == 0 {
		return
	}
	_, c.err = c.w.Write(make([]byte, 4-n%4))
}

// Dir adds name and its parents as directories.
func (c *cpioWriter) Dir(name string) {
	name = path.Clean("/" + name)
	if name == "/" || c.dirs[name] {
		return
	}
	c.Dir(path.Dir(name))
	c.dirs[name] = true
	c.header(name, 0o40755, 0)
}

// Bytes adds a regular file.
func (c *cpioWriter) Bytes(name string, perm fs.FileMode, data []byte) {
	c.Dir(path.Dir(path.Clean("/" + name)))
	c.header(name, 0o100000|uint32(perm.Perm()), len(data))
	if c.err == nil {
		_, c.err = c.w.Write(data)
	}
	c.pad(len(data))
}

// Symlink adds a symbolic link.
func (c *cpioWriter) Symlink(name, target string) {
	c.Dir(path.Dir(path.Clean("/" + name)))
	c.header(name, 0o120777, len(target))
	if c.err == nil {
		_, c.err = io.WriteString(c.w, target)
	}
	c.pad(len(target))
}

// File adds the host file or directory tree src as name.
func (c *cpioWriter) File(name, src string) {
	if c.err != nil {
		return
	}
	c.err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		dst := path.Join(name, filepath.ToSlash(rel))
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			c.Dir(dst)
		case info.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			c.Symlink(dst, target)
		case info.Mode().IsRegular():
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			c.Dir(path.Dir(dst))
			c.header(dst, 0o100000|uint32(info.Mode().Perm()), int(info.Size()))
			if c.err == nil {
				var n int64
				n, c.err = io.Copy(c.w, f)
				if c.err == nil && n != info.Size() {
					c.err = fmt.Errorf("cpio: %s changed size while archived", p)
				}
			}
			c.pad(int(info.Size()))
		default:
			return fmt.Errorf("cpio: %s: unsupported file type %v", p, info.Mode().Type())
		}
		return c.err
	})
}

// Close writes the trailer.
func (c *cpioWriter) Close() error {
	c.header("TRAILER!!!", 0, 0)
	return c.err
}
