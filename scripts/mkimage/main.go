// Command mkimage writes berth's container image archive from a root tree
// and the files added over it (see internal/image and scripts/image.sh),
// then reads it back and checks every digest.
//
//	go run ./scripts/mkimage -root DIR -add SRC:/path/in/image:0755 ... \
//		-name ghcr.io/berth-csi/berth -tag VERSION -epoch SOURCE_DATE_EPOCH -o berth.tar
//
// -entrypoint and -cmd (comma-separated) default to berth serve; make e2e
// writes its test images with other values.
package main

import (
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/berth-csi/berth/internal/image"
)

type adds []image.File

func (a *adds) String() string { return fmt.Sprint(*a) }

func (a *adds) Set(v string) error {
	parts := strings.Split(v, ":")
	if len(parts) != 3 {
		return fmt.Errorf("-add %q: want SOURCE:/path/in/image:MODE", v)
	}
	mode, err := strconv.ParseUint(parts[2], 8, 32)
	if err != nil {
		return fmt.Errorf("-add %q: mode: %w", v, err)
	}
	*a = append(*a, image.File{Source: parts[0], Path: parts[1], Mode: fs.FileMode(mode)})
	return nil
}

func main() {
	var (
		o     image.Options
		add   adds
		epoch int64
		out   string
		entry string
		cmd   string
	)
	flag.StringVar(&o.Root, "root", "", "root tree of the image")
	flag.Var(&add, "add", "SOURCE:/path/in/image:MODE, a file placed over the tree (repeatable)")
	flag.StringVar(&o.Name, "name", "ghcr.io/berth-csi/berth", "image name")
	flag.StringVar(&o.Tag, "tag", "", "image tag (berth's version)")
	flag.Int64Var(&epoch, "epoch", 0, "SOURCE_DATE_EPOCH: every file's time and the creation time")
	flag.StringVar(&out, "o", "", "archive to write")
	flag.StringVar(&entry, "entrypoint", "/usr/local/bin/berth", "the image's entrypoint, comma-separated")
	flag.StringVar(&cmd, "cmd", "serve", "the image's command, comma-separated (empty: none)")
	flag.Parse()
	if o.Root == "" || out == "" || o.Tag == "" {
		flag.Usage()
		os.Exit(2)
	}
	o.Add = add
	o.Epoch = time.Unix(epoch, 0).UTC()
	o.Entrypoint = list(entry)
	o.Cmd = list(cmd)
	o.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	o.Labels = map[string]string{
		"org.opencontainers.image.title":   path.Base(o.Name),
		"org.opencontainers.image.version": o.Tag,
		"org.opencontainers.image.source":  "https://github.com/berth-csi/berth",
	}
	if err := run(o, out); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func list(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func run(o image.Options, out string) (retErr error) {
	tmp, err := os.CreateTemp(filepath.Dir(out), ".mkimage-*")
	if err != nil {
		return err
	}
	defer func() {
		if retErr != nil {
			os.Remove(tmp.Name())
		}
	}()
	res, err := image.Write(tmp, o)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	f, err := os.Open(tmp.Name())
	if err != nil {
		return err
	}
	refs, err := image.Verify(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("the archive written does not verify: %w", err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return err
	}
	fi, err := os.Stat(out)
	if err != nil {
		return err
	}
	fmt.Printf("image:    %s\n", strings.Join(refs, " "))
	fmt.Printf("archive:  %s (%.1f MiB)\n", out, float64(fi.Size())/(1<<20))
	fmt.Printf("digest:   %s\n", res.ManifestDigest)
	fmt.Printf("id:       %s\n", res.ConfigDigest)
	fmt.Printf("layer:    %s (%.1f MiB uncompressed)\n", res.LayerDigest, float64(res.LayerSize)/(1<<20))
	return nil
}
