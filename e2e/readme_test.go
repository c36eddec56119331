package e2e

import (
	"bufio"
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// readmeFiles are the documents TestREADME runs, relative to the repo root.
var readmeFiles = []string{"README.md", "clients/python/README.md"}

// A fenced block may carry a marker on the line right before its fence,
// "<!-- readme-test: KIND -->" or "<!-- readme-test: KIND: TEXT -->":
//
//	skip   not run; TEXT says why and must be there
//	ci     not run here because .ci/run runs it: every line is a make
//	       command whose targets .ci/run makes
//	gpu    run only with EXPERTD_CUDA=1 (a GPU and the cuda backend)
//	torch  needs torch and transformers: not run under EXPERTD_E2E_TORCH=0,
//	       the quick path that leaves them out
//	venv   a pip install: run in a fresh venv with pip's dependency
//	       resolution off (PIP_NO_DEPS), so it neither downloads torch nor
//	       touches the venv the other tests use
var markerRE = regexp.MustCompile(`^<!-- readme-test: ([a-z]+)(?:: (.*?))? -->$`)

// readmeBlock is one fenced code block of a README.
type readmeBlock struct {
	file string
	line int // of the opening fence
	lang string
	kind string // the marker's kind, "" without one
	why  string // the marker's text
	text string
}

func (b readmeBlock) where() string { return fmt.Sprintf("%s:%d", b.file, b.line) }

// readmeBlocks parses the fenced blocks of a Markdown file.
func readmeBlocks(t *testing.T, root, file string) []readmeBlock {
	t.Helper()
	src, err := os.ReadFile(filepath.Join(root, file))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(src), "\n")
	var blocks []readmeBlock
	for i := 0; i < len(lines); i++ {
		if !strings.HasPrefix(lines[i], "```") {
			continue
		}
		b := readmeBlock{file: file, line: i + 1, lang: strings.TrimSpace(strings.TrimPrefix(lines[i], "```"))}
		if i > 0 {
			if m := markerRE.FindStringSubmatch(lines[i-1]); m != nil {
				b.kind, b.why = m[1], m[2]
			} else if strings.HasPrefix(lines[i-1], "<!-- readme-test") {
				t.Errorf("%s: malformed marker %q: want <!-- readme-test: KIND --> or <!-- readme-test: KIND: TEXT -->", b.where(), lines[i-1])
			}
		}
		end := i + 1
		for end < len(lines) && lines[end] != "```" {
			end++
		}
		if end == len(lines) {
			t.Fatalf("%s: unclosed code block", b.where())
		}
		b.text = strings.Join(lines[i+1:end], "\n")
		blocks = append(blocks, b)
		i = end
	}
	return blocks
}

// readmeRun is one README's walk-through: its blocks run in order, from
// the repository root, each shell command group in a shell of its own.
// The environment is the one the set-up leaves: ./bin first on PATH.
// Three literal strings of the blocks are replaced, so that the run takes
// nothing shared on this machine: localhost:50051 by the address of the
// daemon the last "expertd" command started (on a free port: the daemon
// reads EXPERTD_LISTEN), /tmp/ by a directory of the test's own, and
// .tools/e2e/ by $EXPERTD_E2E_TOOLS when that is set (where
// scripts/e2e-setup.sh installed the tools then).
type readmeRun struct {
	t      *testing.T
	root   string
	tmp    string
	tools  string
	python string
	env    []string
	d      *daemon
}

func (r *readmeRun) subst(b readmeBlock, s string) string {
	if strings.Contains(s, "localhost:50051") {
		if r.d == nil {
			r.t.Fatalf("%s: uses localhost:50051, but no block before it starts expertd", b.where())
		}
		s = strings.ReplaceAll(s, "localhost:50051", r.d.Addr)
	}
	if r.tools != "" {
		s = strings.ReplaceAll(s, ".tools/e2e/", r.tools+"/")
	}
	return strings.ReplaceAll(s, "/tmp/", r.tmp+"/")
}

// commands splits a shell block into its commands: lines, joined where
// one ends with a backslash.
func commands(text string) []string {
	var cmds []string
	cur := ""
	for _, line := range strings.Split(text, "\n") {
		cur += line
		if strings.HasSuffix(line, `\`) {
			cur += "\n"
			continue
		}
		cmds = append(cmds, cur)
		cur = ""
	}
	if cur != "" {
		cmds = append(cmds, cur)
	}
	return cmds
}

// isDaemon reports whether a command starts the daemon.
func isDaemon(cmd string) bool {
	f := strings.Fields(cmd)
	return len(f) > 0 && f[0] == "expertd"
}

// shell runs a shell block: its commands in one shell up to an "expertd"
// command, which the harness starts itself (stopping the daemon an
// earlier one started, as a reader stops theirs: both want the port) and
// waits for until it serves, as a reader would before the next command.
func (r *readmeRun) shell(b readmeBlock, extraEnv ...string) {
	var group []string
	flush := func() {
		if len(group) > 0 {
			r.bash(b, r.subst(b, strings.Join(group, "\n")), extraEnv)
			group = nil
		}
	}
	for _, cmd := range commands(b.text) {
		if isDaemon(cmd) {
			flush()
			r.startDaemon(b, cmd)
			continue
		}
		group = append(group, cmd)
	}
	flush()
}

func (r *readmeRun) bash(b readmeBlock, script string, extraEnv []string) {
	t := r.t
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	cmd.Dir = r.root
	cmd.Env = append(slices.Clone(r.env), extraEnv...)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("%s: $ %s\n%s(%.1fs)", b.where(), strings.ReplaceAll(script, "\n", "\n  "), out, time.Since(start).Seconds())
	if err != nil {
		t.Fatalf("%s: the block failed: %v", b.where(), err)
	}
}

func (r *readmeRun) startDaemon(b readmeBlock, line string) {
	t := r.t
	if r.d != nil {
		r.d.stop(t)
		r.d = nil
	}
	line = r.subst(b, strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(line), "&")))
	t.Logf("%s: $ %s   (on a free port, JSON logs)", b.where(), line)
	cmd := exec.Command("bash", "-c", "exec "+line)
	cmd.Dir = r.root
	cmd.Env = append(slices.Clone(r.env), "EXPERTD_LISTEN=127.0.0.1:0", "EXPERTD_ADMIN_ADDR=", "EXPERTD_LOG_FORMAT=json")
	d := startCmd(t, cmd)
	d.waitServing(t, time.After(startTimeout))
	r.d = d
}

func (r *readmeRun) pythonBlock(b readmeBlock) {
	t := r.t
	script := filepath.Join(r.tmp, fmt.Sprintf("readme-%d.py", b.line))
	if err := os.WriteFile(script, []byte(r.subst(b, b.text)), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, r.python, script)
	cmd.Dir = r.root
	cmd.Env = r.env
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("%s: python\n%s(%.1fs)", b.where(), out, time.Since(start).Seconds())
	if err != nil {
		t.Fatalf("%s: the block failed: %v", b.where(), err)
	}
}

// venvBlock runs a pip block in a fresh venv with dependencies left out.
func (r *readmeRun) venvBlock(b readmeBlock) {
	venv := filepath.Join(r.tmp, fmt.Sprintf("venv-%d", b.line))
	if _, err := run(r.t, nil, r.python, "-m", "venv", venv); err != nil {
		r.t.Fatal(err)
	}
	r.shell(b, "VIRTUAL_ENV="+venv, "PATH="+filepath.Join(venv, "bin")+":"+os.Getenv("PATH"),
		"PIP_NO_DEPS=1", "PIP_DISABLE_PIP_VERSION_CHECK=1")
}

// ciTargets are the make targets .ci/run makes.
func ciTargets(t *testing.T, root string) []string {
	src, err := os.ReadFile(filepath.Join(root, ".ci/run"))
	if err != nil {
		t.Fatal(err)
	}
	var targets []string
	for _, m := range regexp.MustCompile(`(?m)^\s*make ([^#\n]+)`).FindAllStringSubmatch(string(src), -1) {
		targets = append(targets, strings.Fields(m[1])...)
	}
	return targets
}

// checkCI checks that a block marked ci holds only make commands .ci/run
// runs too.
func checkCI(t *testing.T, b readmeBlock, targets []string) {
	for _, cmd := range commands(b.text) {
		cmd, _, _ = strings.Cut(cmd, "#")
		f := strings.Fields(cmd)
		if len(f) == 0 {
			continue
		}
		if f[0] != "make" || len(f) < 2 {
			t.Errorf("%s: a block marked ci holds %q; only make commands that .ci/run runs may be left to it", b.where(), cmd)
			continue
		}
		for _, target := range f[1:] {
			if !slices.Contains(targets, target) {
				t.Errorf("%s: marked ci, but .ci/run never makes %q (it makes %v)", b.where(), target, targets)
			}
		}
	}
}

// exampleBodies are the bodies of the Example functions of client/, each
// as the README shows it: one tab less, without the Output comment.
func exampleBodies(t *testing.T, root string) map[string]string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "client", "*_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	bodies := map[string]string{}
	fset := token.NewFileSet()
	for _, path := range files {
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, path, src, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil || !strings.HasPrefix(fn.Name.Name, "Example") {
				continue
			}
			body := string(src[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset])
			if i := strings.Index(body, "\t// Output:"); i >= 0 {
				body = body[:i]
			}
			var lines []string
			for _, l := range strings.Split(body, "\n") {
				lines = append(lines, strings.TrimPrefix(l, "\t"))
			}
			bodies[fn.Name.Name] = trimBlank(strings.Join(lines, "\n"))
		}
	}
	return bodies
}

func trimBlank(s string) string { return strings.Trim(s, "\n") }

// checkGo checks that a Go block is the body of an Example of client/,
// which go test runs.
func checkGo(t *testing.T, b readmeBlock, bodies map[string]string) {
	text := trimBlank(b.text)
	best, bestLine := "", -1
	for name, body := range bodies {
		if body == text {
			t.Logf("%s: the body of client's %s", b.where(), name)
			return
		}
		// Name the example whose first lines agree longest, and where
		// they part.
		bl, tl := strings.Split(body, "\n"), strings.Split(text, "\n")
		n := 0
		for n < len(bl) && n < len(tl) && bl[n] == tl[n] {
			n++
		}
		if n > bestLine {
			best, bestLine = name, n
		}
	}
	t.Errorf("%s: this Go block is not the body of an Example in client/ (mark it <!-- readme-test: skip: WHY --> if it cannot run); closest: %s, which departs at the block's line %d", b.where(), best, bestLine+1)
}

// treeEntries is what git status lists in the work tree, ignored files
// included, less the ./bin the set-up builds and Python's caches.
func treeEntries(t *testing.T, root string) []string {
	t.Helper()
	cmd := exec.Command("git", "status", "--porcelain", "--ignored", "--untracked-files=normal")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git status: %v", err)
	}
	var entries []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		e := sc.Text()
		if strings.Contains(e, "__pycache__/") || strings.Contains(e, " bin/") {
			continue
		}
		entries = append(entries, e)
	}
	return entries
}

// TestREADME runs every shell, Python and Go block of the READMEs as
// written, in order, against the real daemon on the CPU backend: shell
// blocks in bash from the repository root (the set-up's make build
// included, so the daemon is ./bin/expertd as the README starts it),
// Python blocks with the e2e venv's Python, and Go blocks by checking
// that each is the body of a client/ Example, which go test runs.
// Markers (markerRE) say which blocks run only where something is
// available, and why any is not run. Blocks must not leave files in the
// tree.
func TestREADME(t *testing.T) {
	root := repoRoot(t)
	python := pythonPath(t)
	tools := os.Getenv("EXPERTD_E2E_TOOLS")
	if tools != "" {
		var err error
		if tools, err = filepath.Abs(tools); err != nil {
			t.Fatal(err)
		}
	}
	targets := ciTargets(t, root)
	bodies := exampleBodies(t, root)
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PATH=") {
			env = append(env, kv)
		}
	}
	env = append(env, "PATH="+filepath.Join(root, "bin")+":"+os.Getenv("PATH"))
	before := treeEntries(t, root)

	for _, file := range readmeFiles {
		t.Run(file, func(t *testing.T) {
			r := &readmeRun{t: t, root: root, tmp: t.TempDir(), tools: tools, python: python, env: env}
			ran := 0
			for _, b := range readmeBlocks(t, root, file) {
				if b.lang != "sh" && b.lang != "python" && b.lang != "go" {
					if b.kind != "" {
						t.Errorf("%s: a marker on a %q block, which is not run anyway", b.where(), b.lang)
					}
					continue
				}
				switch b.kind {
				case "":
				case "skip":
					if strings.TrimSpace(b.why) == "" {
						t.Errorf("%s: a skipped block must say why: <!-- readme-test: skip: WHY -->", b.where())
					}
					t.Logf("%s: not run: %s", b.where(), b.why)
					continue
				case "ci":
					checkCI(t, b, targets)
					t.Logf("%s: not run here: .ci/run runs it", b.where())
					continue
				case "gpu":
					if os.Getenv("EXPERTD_CUDA") != "1" {
						t.Logf("%s: not run: it needs a GPU and the cuda backend (EXPERTD_CUDA=1)", b.where())
						continue
					}
				case "torch":
					if os.Getenv("EXPERTD_E2E_TORCH") == "0" {
						t.Logf("%s: not run: it needs torch, which EXPERTD_E2E_TORCH=0 leaves out", b.where())
						continue
					}
				case "venv":
					if b.lang != "sh" {
						t.Fatalf("%s: venv marks a shell block", b.where())
					}
					r.venvBlock(b)
					ran++
					continue
				default:
					t.Fatalf("%s: unknown marker %q (want skip, ci, gpu, torch or venv)", b.where(), b.kind)
				}
				switch b.lang {
				case "sh":
					r.shell(b)
				case "python":
					r.pythonBlock(b)
				case "go":
					checkGo(t, b, bodies)
				}
				ran++
			}
			if ran == 0 {
				t.Errorf("%s: no block ran", file)
			}
		})
	}
	if after := treeEntries(t, root); !slices.Equal(before, after) {
		t.Errorf("the README's blocks changed the work tree (every output belongs under /tmp or in ./bin):\nbefore: %q\nafter:  %q", before, after)
	}
}
