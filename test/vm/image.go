package vm

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
)

// image is the cached guest image made by test/vm/image/build.sh.
type image struct {
	kernelVersion string
	kernel        string
	baseInitramfs string
	rootDisk      string
	kernelArgs    string // added to the kernel command line
}

// builtImage is the result of one run of build.sh.
type builtImage struct {
	once sync.Once
	img  *image
	log  string
	err  error
}

var (
	images sync.Map // kernel suite ("" for the default) -> *builtImage

	rootOnce sync.Once
	rootDir  string
	rootErr  error
)

// goTool returns the go command of $GOROOT when set (go test sets it for
// the test binary), or the one on PATH.
func goTool() string {
	if root := os.Getenv("GOROOT"); root != "" {
		if p := filepath.Join(root, "bin", "go"); fileExists(p) {
			return p
		}
	}
	return "go"
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// moduleRoot is the directory of the berth module's go.mod.
func moduleRoot() (string, error) {
	rootOnce.Do(func() {
		out, err := exec.Command(goTool(), "env", "GOMOD").Output()
		if err != nil {
			rootErr = fmt.Errorf("go env GOMOD: %w", err)
			return
		}
		gomod := strings.TrimSpace(string(out))
		if gomod == "" || gomod == os.DevNull {
			rootErr = errors.New("not inside a Go module")
			return
		}
		dir := filepath.Dir(gomod)
		// A nested module (test/sanity) is not the berth module: walk up.
		for !fileExists(filepath.Join(dir, "test", "vm", "image", "build.sh")) {
			parent := filepath.Dir(dir)
			if parent == dir {
				rootErr = fmt.Errorf("no test/vm/image/build.sh above %s", gomod)
				return
			}
			dir = parent
		}
		rootDir = dir
	})
	return rootDir, rootErr
}

// loadImage runs build.sh once per process and kernel suite ("" for the
// default kernel, else the Debian suite whose cloud kernel the image
// boots): it returns at once when the cache is current and builds what is
// missing otherwise.
func loadImage(suite string) (*image, string, error) {
	v, _ := images.LoadOrStore(suite, &builtImage{})
	b := v.(*builtImage)
	b.once.Do(func() {
		root, err := moduleRoot()
		if err != nil {
			b.err = err
			return
		}
		var args []string
		if suite != "" {
			args = append(args, suite)
		}
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(filepath.Join(root, "test", "vm", "image", "build.sh"), args...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err = cmd.Run()
		b.log = stderr.String()
		if err != nil {
			b.err = fmt.Errorf("test/vm/image/build.sh %s: %w\n%s", suite, err, tail(b.log, 30))
			return
		}
		dir := strings.TrimSpace(lastLine(stdout.String()))
		b.img, b.err = readImageEnv(filepath.Join(dir, "image.env"))
	})
	return b.img, b.log, b.err
}

func readImageEnv(p string) (*image, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("guest image: %w", err)
	}
	defer f.Close()
	kv := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			kv[k] = v
		}
	}
	img := &image{
		kernelVersion: kv["KERNEL_VERSION"],
		kernel:        kv["KERNEL"],
		baseInitramfs: kv["BASE_INITRAMFS"],
		rootDisk:      kv["ROOT_DISK"],
		kernelArgs:    kv["KERNEL_ARGS"],
	}
	for _, f := range []string{img.kernel, img.baseInitramfs} {
		if f == "" || !fileExists(f) {
			return nil, fmt.Errorf("guest image %s: missing %q (rerun test/vm/image/build.sh)", p, f)
		}
	}
	return img, sc.Err()
}

// processDir is a directory for what the runs of this test process share. It
// is named after the process; directories of processes that are gone are
// removed.
func processDir() (string, error) {
	base := filepath.Join(os.TempDir(), "berth-vm-proc")
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	if ents, err := os.ReadDir(base); err == nil {
		for _, e := range ents {
			if pid, err := strconv.Atoi(e.Name()); err == nil && !fileExists(fmt.Sprintf("/proc/%d", pid)) {
				os.RemoveAll(filepath.Join(base, e.Name()))
			}
		}
	}
	dir := filepath.Join(base, strconv.Itoa(os.Getpid()))
	return dir, os.MkdirAll(dir, 0o755)
}

var berthBinaries sync.Map // build tags -> *builtBinary

// buildBerth builds the berth binary from the module root, with the given
// build tags (comma-separated, "" for none), once per process and tags.
func buildBerth(tags string) (string, error) {
	v, _ := berthBinaries.LoadOrStore(tags, &builtBinary{})
	b := v.(*builtBinary)
	b.once.Do(func() {
		root, err := moduleRoot()
		if err != nil {
			b.err = err
			return
		}
		dir, err := processDir()
		if err != nil {
			b.err = err
			return
		}
		b.path = filepath.Join(dir, "berth")
		if tags != "" {
			b.path += "-" + strings.ReplaceAll(tags, ",", "-")
		}
		// Without symbol table and DWARF: a smaller initramfs loads faster
		// (panics keep their stack traces).
		cmd := exec.Command(goTool(), "build", "-tags", tags, "-ldflags=-s -w", "-o", b.path, ".")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("go build -tags %q berth: %w\n%s", tags, err, out)
		}
	})
	return b.path, b.err
}

type builtBinary struct {
	once sync.Once
	path string
	err  error
}

var testBinaries sync.Map // package dir -> *builtBinary

// testBinary builds the test binary of the package in pkgDir once per process.
func testBinary(pkgDir string) (string, error) {
	v, _ := testBinaries.LoadOrStore(pkgDir, &builtBinary{})
	b := v.(*builtBinary)
	b.once.Do(func() {
		dir, err := processDir()
		if err != nil {
			b.err = err
			return
		}
		f, err := os.CreateTemp(dir, "guest-*.test")
		if err != nil {
			b.err = err
			return
		}
		f.Close()
		b.path = f.Name()
		b.err = buildTestBinary(pkgDir, b.path)
	})
	return b.path, b.err
}

// buildTestBinary builds the test binary of the package in pkgDir.
func buildTestBinary(pkgDir, out string) error {
	args := []string{"test", "-c", "-ldflags=-s -w", "-o", out}
	if coverDir() != "" {
		args = append(args, "-cover", "-coverpkg="+coverPackages)
	}
	cmd := exec.Command(goTool(), append(args, ".")...)
	cmd.Dir = pkgDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go test -c in %s: %w\n%s", pkgDir, err, b)
	}
	return nil
}

func lastLine(s string) string {
	s = strings.TrimRight(s, "\n")
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
