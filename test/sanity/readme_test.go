package sanity

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// readmeSkip marks a README block the test must not run; the reason is
// required. It stands on the line right before the block's opening fence.
var readmeSkip = regexp.MustCompile(`^<!-- readme-test: skip: (.*) -->$`)

// readmeSection is the runnable shell of one README section.
type readmeSection struct {
	heading string
	blocks  []string
}

// readmeSections returns the sh blocks of a README, grouped by section,
// without the blocks marked with readmeSkip. A marker that is not followed
// by a block, or gives no reason, is an error: a stale marker would hide
// nothing, a bare one explains nothing.
func readmeSections(text string) (run []readmeSection, skipped []string, err error) {
	var (
		cur     *readmeSection
		inBlock bool
		lang    string
		block   strings.Builder
		skip    string // reason of a marker on the previous line
		marker  int    // its line number
	)
	s := bufio.NewScanner(strings.NewReader(text))
	for n := 1; s.Scan(); n++ {
		line := s.Text()
		if inBlock {
			if strings.TrimSpace(line) == "```" {
				inBlock = false
				switch {
				case lang != "sh":
				case skip != "":
					skipped = append(skipped, cur.heading+": "+skip)
				default:
					cur.blocks = append(cur.blocks, block.String())
				}
				skip = ""
				continue
			}
			block.WriteString(line + "\n")
			continue
		}
		if skip != "" && !strings.HasPrefix(line, "```") {
			return nil, nil, fmt.Errorf("line %d: readme-test marker not followed by a code block", marker)
		}
		switch {
		case strings.HasPrefix(line, "#"):
			run = append(run, readmeSection{heading: strings.TrimLeft(line, "# ")})
			cur = &run[len(run)-1]
		case strings.HasPrefix(line, "```"):
			if cur == nil {
				return nil, nil, fmt.Errorf("line %d: code block before the first heading", n)
			}
			inBlock, lang = true, strings.TrimSpace(strings.TrimPrefix(line, "```"))
			block.Reset()
		case strings.HasPrefix(line, "<!-- readme-test"):
			m := readmeSkip.FindStringSubmatch(line)
			if m == nil || strings.TrimSpace(m[1]) == "" {
				return nil, nil, fmt.Errorf("line %d: %q: want <!-- readme-test: skip: reason -->", n, line)
			}
			skip, marker = m[1], n
		}
	}
	if inBlock {
		return nil, nil, errors.New("README ends inside a code block")
	}
	out := run[:0]
	for _, sec := range run {
		if len(sec.blocks) > 0 {
			out = append(out, sec)
		}
	}
	return out, skipped, s.Err()
}

// readmePrelude runs before a section's commands, inside a mount namespace
// of their own: /srv, /mnt, /run and /var/lib are empty tmpfs there, and
// TMPDIR an empty directory of the test's (a tmpfs of its own too), so
// the commands use the paths as written (mktemp -d included) without
// touching the host's. /tmp itself is left alone: the checkout, berth's
// binary or Go's caches may be below it. A checkout below one of the
// other four would be hidden, and is refused. On exit it stops what the
// commands left running, unmounts what they left mounted and detaches
// loop devices over their image files, so that a failed step leaves
// nothing behind.
const readmePrelude = `set -euo pipefail
for d in /srv /mnt /run /var/lib; do
	case "$PWD/" in "$d"/*) echo "README test: the checkout $PWD is below $d, which the test hides: clone it elsewhere" >&2; exit 1 ;; esac
done
for d in /srv /mnt /run /var/lib "$TMPDIR"; do mount -t tmpfs readme-test "$d"; done
cleanup() {
	rc=$?
	set +e
	jobs -p | xargs -r kill 2>/dev/null
	wait
	for d in /mnt /srv "$TMPDIR"; do
		findmnt -rn -R -o TARGET --mountpoint "$d" | tail -n +2 | sort -r | xargs -r -n1 umount
	done
	find /srv "$TMPDIR" -type f | while read -r f; do
		losetup -j "$f" -n -O NAME | xargs -r -n1 losetup -d
	done
	exit $rc
}
trap cleanup EXIT
trap 'exit 143' TERM
set -x
`

// readmeFiles are the documents whose sh blocks TestREADME runs: the
// README, CONTRIBUTING.md and every page under docs/.
func readmeFiles(repo string) ([]string, error) {
	docs, err := filepath.Glob(filepath.Join(repo, "docs", "*.md"))
	if err != nil {
		return nil, err
	}
	return append([]string{filepath.Join(repo, "README.md"), filepath.Join(repo, "CONTRIBUTING.md")}, docs...), nil
}

// readmeWalkthrough is the heading of the README's csc walkthrough, which
// TestREADME runs twice in a row: a second run on the same host must work
// as the first did.
const readmeWalkthrough = "A first volume by hand (file transport, csc)"

// TestREADME runs the sh blocks of the README and of docs/*.md, section by
// section, each section in one bash, as root on this host. The csc
// walkthrough takes a file volume through stage, publish, stats, expand,
// unpublish and unstage with bin/berth and a csc built from this module's
// go.mod, then cleans up; it runs twice.
func TestREADME(t *testing.T) {
	if os.Getenv("BERTH_BIN") == "" || os.Geteuid() != 0 {
		why := "needs root and BERTH_BIN (the berth binary; run `make sanity-test`)"
		if os.Getenv("BERTH_CI") == "1" {
			t.Fatal("BERTH_CI=1: " + why)
		}
		t.Skip(why)
	}
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	// The README runs berth as bin/berth, the binary of make build.
	if _, err := os.Stat(filepath.Join(repo, "bin", "berth")); err != nil {
		t.Fatalf("the README uses bin/berth: run make build first (%v)", err)
	}
	for _, tool := range []string{"unshare", "findmnt", "losetup", "mkfs.xfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s: %v (make deps installs it)", tool, err)
		}
	}
	files, err := readmeFiles(repo)
	if err != nil {
		t.Fatal(err)
	}
	ran := map[string]bool{}
	for _, path := range files {
		name, _ := filepath.Rel(repo, path)
		text, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		sections, skipped, err := readmeSections(string(text))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, s := range skipped {
			t.Logf("not run: %s: %s", name, s)
		}
		for _, sec := range sections {
			ran[name+": "+sec.heading] = true
			runs := 1
			if name == "README.md" && sec.heading == readmeWalkthrough {
				runs = 2
			}
			for i := 1; i <= runs; i++ {
				t.Run(fmt.Sprintf("%s/%s/run%d", name, sec.heading, i), func(t *testing.T) { runReadmeSection(t, repo, sec) })
			}
		}
	}
	// The walkthrough must not go unnoticed into a skip.
	if !ran["README.md: "+readmeWalkthrough] {
		t.Fatalf("no runnable block in the csc walkthrough (README.md, %q); sections run: %v", readmeWalkthrough, ran)
	}
}

func runReadmeSection(t *testing.T, repo string, sec readmeSection) {
	script := readmePrelude + strings.Join(sec.blocks, "\n")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script)
	cmd.Dir = repo
	// A short name: the commands put unix sockets below it (108 bytes
	// at most), which t.TempDir's long names would not fit.
	tmp, err := os.MkdirTemp("", "readme")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	env := append(os.Environ(), "TMPDIR="+tmp)
	if _, err := exec.LookPath("go"); err != nil {
		// The README builds csc with go: the toolchain running this test.
		env = append(env, "PATH="+filepath.Join(runtime.GOROOT(), "bin")+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	cmd.Env = env
	// On timeout the whole group gets SIGTERM, so that bash's cleanup
	// runs; SIGKILL follows if it does not finish.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("bash (%s) in a private mount namespace, %.1fs:\n%s", sec.heading, time.Since(start).Seconds(), out)
	if err != nil {
		t.Fatalf("README section %q: %v", sec.heading, err)
	}
}

func TestReadmeSections(t *testing.T) {
	text := "# A\n\n<!-- readme-test: skip: needs a cluster -->\n```sh\nkubectl apply\n```\n\n## B\n```sh\necho 1\n```\ntext\n```\nnot sh\n```\n```sh\necho 2\n```\n### C\n```go\nx\n```\n"
	run, skipped, err := readmeSections(text)
	if err != nil {
		t.Fatal(err)
	}
	if len(run) != 1 || run[0].heading != "B" || strings.Join(run[0].blocks, "") != "echo 1\necho 2\n" {
		t.Fatalf("sections %+v", run)
	}
	if len(skipped) != 1 || skipped[0] != "A: needs a cluster" {
		t.Fatalf("skipped %v", skipped)
	}
	for _, bad := range []string{
		"# A\n<!-- readme-test: skip: -->\n```sh\nx\n```\n",
		"# A\n<!-- readme-test: skip: why -->\n\n```sh\nx\n```\n",
		"# A\n<!-- readme-test: run -->\n```sh\nx\n```\n",
		"# A\n```sh\nx\n",
	} {
		if _, _, err := readmeSections(bad); err == nil {
			t.Errorf("readmeSections accepted %q", bad)
		}
	}
}
