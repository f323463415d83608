// Package image writes berth's container image as a single-layer archive
// that `docker load`, `podman load` and `ctr images import` all read: the
// docker-save manifest.json (RepoTags) beside an OCI image layout
// (oci-layout, index.json, blobs/sha256), sharing one set of blobs, as
// docker save itself writes since Docker 25.
//
// Archives are reproducible: the layer's entries are sorted by path, every
// time is the given epoch, owners are numeric without names, and JSON is
// written with sorted keys, so the same tree gives the same digests.
//
// go-containerregistry's archive writer (tarball.Write) writes docker save's
// format alone: containerd then imports a Docker manifest it converts
// itself, under another digest than the OCI manifest the build names, and
// no OCI layout reader can read the archive. The OCI layout half is why
// this package writes the archive itself; crane validate checks it in make
// image-check.
package image

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// Media types of the OCI image spec.
const (
	MediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	MediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	MediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar"
	MediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
)

// File is a file added to the layer from outside the root tree.
type File struct {
	Source string      // file on the host
	Path   string      // absolute path in the image
	Mode   fs.FileMode // permission bits
}

// Options describe the image.
type Options struct {
	// Root is the directory tree of the image's filesystem.
	Root string
	// Add are files placed over the tree (berth, its wrappers).
	Add []File
	// Name and Tag make the image reference Name:Tag.
	Name, Tag string
	// Epoch is every file's modification time and the image's creation
	// time (SOURCE_DATE_EPOCH).
	Epoch time.Time
	// Entrypoint, Cmd and Env of the image config.
	Entrypoint, Cmd, Env []string
	// Labels of the image config.
	Labels map[string]string
}

// Descriptor is an OCI content descriptor.
type Descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// Manifest is an OCI image manifest.
type Manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        Descriptor   `json:"config"`
	Layers        []Descriptor `json:"layers"`
}

// Index is an OCI image index (index.json).
type Index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []Descriptor `json:"manifests"`
}

// DockerManifest is one entry of docker save's manifest.json.
type DockerManifest struct {
	Config   string
	RepoTags []string
	Layers   []string
}

// Config is the part of the OCI image config berth writes.
type Config struct {
	Created      string        `json:"created"`
	Architecture string        `json:"architecture"`
	OS           string        `json:"os"`
	Config       RuntimeConfig `json:"config"`
	RootFS       RootFS        `json:"rootfs"`
	History      []History     `json:"history"`
}

// RuntimeConfig is the execution part of the image config.
type RuntimeConfig struct {
	Entrypoint []string          `json:"Entrypoint,omitempty"`
	Cmd        []string          `json:"Cmd,omitempty"`
	Env        []string          `json:"Env,omitempty"`
	Labels     map[string]string `json:"Labels,omitempty"`
}

// RootFS lists the layers' uncompressed digests.
type RootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

// History is one step of the image's history.
type History struct {
	Created   string `json:"created"`
	CreatedBy string `json:"created_by"`
}

// Result names what Write wrote.
type Result struct {
	Reference      string // Name:Tag
	ManifestDigest string // the image's digest (sha256:...)
	ConfigDigest   string // the image ID
	LayerDigest    string // = the layer's diff_id (uncompressed)
	LayerSize      int64
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

func blobPath(d string) string { return "blobs/sha256/" + strings.TrimPrefix(d, "sha256:") }

// Write writes the image archive to w.
func Write(w io.Writer, o Options) (Result, error) {
	if o.Name == "" || o.Tag == "" || strings.ContainsAny(o.Name+o.Tag, " \t\n@") || strings.Contains(o.Tag, "/") || strings.Contains(o.Tag, ":") {
		return Result{}, fmt.Errorf("image reference %q:%q: want a name and a tag", o.Name, o.Tag)
	}
	var layer bytes.Buffer
	if err := WriteLayer(&layer, o.Root, o.Add, o.Epoch); err != nil {
		return Result{}, err
	}
	layerDigest := digest(layer.Bytes())
	created := o.Epoch.UTC().Format(time.RFC3339)
	cfg := Config{
		Created:      created,
		Architecture: "amd64",
		OS:           "linux",
		Config:       RuntimeConfig{Entrypoint: o.Entrypoint, Cmd: o.Cmd, Env: o.Env, Labels: o.Labels},
		RootFS:       RootFS{Type: "layers", DiffIDs: []string{layerDigest}},
		History:      []History{{Created: created, CreatedBy: "make image"}},
	}
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return Result{}, err
	}
	cfgDigest := digest(cfgJSON)
	man := Manifest{
		SchemaVersion: 2,
		MediaType:     MediaTypeManifest,
		Config:        Descriptor{MediaType: MediaTypeConfig, Digest: cfgDigest, Size: int64(len(cfgJSON))},
		Layers:        []Descriptor{{MediaType: MediaTypeLayer, Digest: layerDigest, Size: int64(layer.Len())}},
	}
	manJSON, err := json.Marshal(man)
	if err != nil {
		return Result{}, err
	}
	manDigest := digest(manJSON)
	ref := o.Name + ":" + o.Tag
	index := Index{SchemaVersion: 2, MediaType: MediaTypeIndex, Manifests: []Descriptor{{
		MediaType: MediaTypeManifest, Digest: manDigest, Size: int64(len(manJSON)),
		Annotations: map[string]string{
			// containerd names the imported image after this one.
			"io.containerd.image.name":          qualified(ref),
			"org.opencontainers.image.ref.name": o.Tag,
		},
	}}}
	indexJSON, err := json.Marshal(index)
	if err != nil {
		return Result{}, err
	}
	dockerJSON, err := json.Marshal([]DockerManifest{{
		Config: blobPath(cfgDigest), RepoTags: []string{ref}, Layers: []string{blobPath(layerDigest)},
	}})
	if err != nil {
		return Result{}, err
	}

	tw := tar.NewWriter(w)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: o.Epoch, Format: tar.FormatPAX})
	}
	file := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: o.Epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	// Blobs sorted by digest, then the top-level files in name order.
	blobs := map[string][]byte{cfgDigest: cfgJSON, manDigest: manJSON, layerDigest: layer.Bytes()}
	keys := make([]string, 0, len(blobs))
	for k := range blobs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if err := dir("blobs/"); err != nil {
		return Result{}, err
	}
	if err := dir("blobs/sha256/"); err != nil {
		return Result{}, err
	}
	for _, k := range keys {
		if err := file(blobPath(k), blobs[k]); err != nil {
			return Result{}, err
		}
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{"index.json", indexJSON},
		{"manifest.json", dockerJSON},
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
	} {
		if err := file(f.name, f.data); err != nil {
			return Result{}, err
		}
	}
	if err := tw.Close(); err != nil {
		return Result{}, err
	}
	return Result{Reference: ref, ManifestDigest: manDigest, ConfigDigest: cfgDigest, LayerDigest: layerDigest, LayerSize: int64(layer.Len())}, nil
}

// qualified is ref as containerd and Kubernetes name it: a name without a
// registry is on docker.io, without a path under library/.
func qualified(ref string) string {
	name := ref
	first, _, hasSlash := strings.Cut(name, "/")
	if !hasSlash || (!strings.ContainsAny(first, ".:") && first != "localhost") {
		if !hasSlash {
			name = "library/" + name
		}
		name = "docker.io/" + name
	}
	return name
}

// entry is one file of the layer.
type entry struct {
	name   string // path in the image, without a leading slash
	source string // file on the host
	fi     fs.FileInfo
	mode   fs.FileMode // for added files: their permission bits
}

// WriteLayer writes root and the added files as one tar layer: sorted
// paths, times set to epoch, numeric owners, hard links kept as links.
// Sockets, devices and fifos are refused: an image has none.
func WriteLayer(w io.Writer, root string, add []File, epoch time.Time) error {
	entries := map[string]entry{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		entries[filepath.ToSlash(rel)] = entry{name: filepath.ToSlash(rel), source: p, fi: fi}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read image root %s: %w", root, err)
	}
	for _, a := range add {
		name := strings.TrimPrefix(path.Clean(a.Path), "/")
		if !path.IsAbs(a.Path) || name == "" {
			return fmt.Errorf("image path %q: want an absolute path", a.Path)
		}
		fi, err := os.Stat(a.Source)
		if err != nil {
			return fmt.Errorf("add %s: %w", a.Source, err)
		}
		if !fi.Mode().IsRegular() {
			return fmt.Errorf("add %s: not a regular file", a.Source)
		}
		entries[name] = entry{name: name, source: a.Source, fi: fi, mode: a.Mode}
		// Parent directories the tree lacks.
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = entry{name: d, mode: fs.ModeDir | 0o755}
			}
		}
	}
	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	sort.Strings(names)

	tw := tar.NewWriter(w)
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	for _, n := range names {
		e := entries[n]
		h := &tar.Header{Name: n, ModTime: epoch, Format: tar.FormatPAX}
		switch {
		case e.fi == nil: // a parent made for an added file
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, n+"/", int64(e.mode.Perm())
		case e.mode != 0: // an added file
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, int64(e.mode.Perm()), e.fi.Size()
		default:
			m := e.fi.Mode()
			h.Mode = int64(m.Perm())
			if m&fs.ModeSetuid != 0 {
				h.Mode |= 0o4000
			}
			if m&fs.ModeSetgid != 0 {
				h.Mode |= 0o2000
			}
			if m&fs.ModeSticky != 0 {
				h.Mode |= 0o1000
			}
			if st, ok := e.fi.Sys().(*syscall.Stat_t); ok {
				h.Uid, h.Gid = int(st.Uid), int(st.Gid)
				if m.IsRegular() && st.Nlink > 1 {
					id := inode{uint64(st.Dev), st.Ino}
					if first, ok := links[id]; ok {
						h.Typeflag, h.Linkname = tar.TypeLink, first
						break
					}
					links[id] = n
				}
			}
			switch {
			case m.IsDir():
				h.Typeflag, h.Name = tar.TypeDir, n+"/"
			case m.IsRegular():
				h.Typeflag, h.Size = tar.TypeReg, e.fi.Size()
			case m&fs.ModeSymlink != 0:
				target, err := os.Readlink(e.source)
				if err != nil {
					return err
				}
				h.Typeflag, h.Linkname = tar.TypeSymlink, target
			default:
				return fmt.Errorf("image root: %s is a %v, which an image does not hold", e.source, m.Type())
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeReg {
			f, err := os.Open(e.source)
			if err != nil {
				return err
			}
			n, err := io.Copy(tw, f)
			f.Close()
			if err != nil {
				return fmt.Errorf("add %s: %w", e.source, err)
			}
			if n != h.Size {
				return fmt.Errorf("add %s: changed while read", e.source)
			}
		}
	}
	return tw.Close()
}

// Verify reads an archive written by Write (or docker save) and checks it
// as the importers do: every blob's digest and size, the config's
// diff_ids against the layers' content, the OCI index, and that
// manifest.json and index.json name the same config and layers. It
// returns the image's references.
func Verify(r io.Reader) ([]string, error) {
	files := map[string][]byte{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read archive: %w", err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return nil, err
		}
		if _, dup := files[h.Name]; dup {
			return nil, fmt.Errorf("archive: %s twice", h.Name)
		}
		files[h.Name] = b
	}
	blob := func(d Descriptor, mediaType string) ([]byte, error) {
		if d.MediaType != mediaType {
			return nil, fmt.Errorf("descriptor %s: media type %q, want %q", d.Digest, d.MediaType, mediaType)
		}
		b, ok := files[blobPath(d.Digest)]
		if !ok {
			return nil, fmt.Errorf("blob %s missing", d.Digest)
		}
		if digest(b) != d.Digest || int64(len(b)) != d.Size {
			return nil, fmt.Errorf("blob %s: content is %s, %d bytes; descriptor says %d bytes", d.Digest, digest(b), len(b), d.Size)
		}
		return b, nil
	}
	var layout struct {
		ImageLayoutVersion string `json:"imageLayoutVersion"`
	}
	if err := json.Unmarshal(files["oci-layout"], &layout); err != nil || layout.ImageLayoutVersion != "1.0.0" {
		return nil, fmt.Errorf("oci-layout: %q, %v", files["oci-layout"], err)
	}
	var index Index
	if err := json.Unmarshal(files["index.json"], &index); err != nil {
		return nil, fmt.Errorf("index.json: %w", err)
	}
	var docker []DockerManifest
	if err := json.Unmarshal(files["manifest.json"], &docker); err != nil {
		return nil, fmt.Errorf("manifest.json: %w", err)
	}
	if index.SchemaVersion != 2 || len(index.Manifests) != 1 || len(docker) != 1 {
		return nil, fmt.Errorf("want one image: index.json has %d manifests, manifest.json %d", len(index.Manifests), len(docker))
	}
	manJSON, err := blob(index.Manifests[0], MediaTypeManifest)
	if err != nil {
		return nil, err
	}
	var man Manifest
	if err := json.Unmarshal(manJSON, &man); err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	cfgJSON, err := blob(man.Config, MediaTypeConfig)
	if err != nil {
		return nil, err
	}
	var cfg Config
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if cfg.OS != "linux" || cfg.Architecture == "" || cfg.RootFS.Type != "layers" || len(cfg.RootFS.DiffIDs) != len(man.Layers) {
		return nil, fmt.Errorf("config: os %q, architecture %q, rootfs %+v for %d layers", cfg.OS, cfg.Architecture, cfg.RootFS, len(man.Layers))
	}
	d := docker[0]
	if d.Config != blobPath(man.Config.Digest) || len(d.Layers) != len(man.Layers) {
		return nil, fmt.Errorf("manifest.json names config %s and %d layers; the OCI manifest %s and %d", d.Config, len(d.Layers), man.Config.Digest, len(man.Layers))
	}
	for i, l := range man.Layers {
		b, err := blob(l, MediaTypeLayer)
		if err != nil {
			return nil, err
		}
		// Uncompressed: the diff_id is the layer's own digest.
		if cfg.RootFS.DiffIDs[i] != digest(b) {
			return nil, fmt.Errorf("layer %d: diff_id %s, content %s", i, cfg.RootFS.DiffIDs[i], digest(b))
		}
		if d.Layers[i] != blobPath(l.Digest) {
			return nil, fmt.Errorf("manifest.json layer %d is %s, the OCI manifest's %s", i, d.Layers[i], l.Digest)
		}
		tr := tar.NewReader(bytes.NewReader(b))
		for {
			if _, err := tr.Next(); err != nil {
				if errors.Is(err, io.EOF) {
					break
				}
				return nil, fmt.Errorf("layer %d is not a tar: %w", i, err)
			}
		}
	}
	if len(d.RepoTags) == 0 {
		return nil, errors.New("manifest.json: no RepoTags")
	}
	if name := index.Manifests[0].Annotations["io.containerd.image.name"]; name != qualified(d.RepoTags[0]) {
		return nil, fmt.Errorf("index.json names the image %q, manifest.json %q", name, d.RepoTags[0])
	}
	return d.RepoTags, nil
}
