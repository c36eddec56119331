package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/expertd/expertd/service/servicetest"
)

// Timeouts of the harness. The daemon build is the slow part on a cold
// cache; once built, a start takes well under a second.
const (
	buildTimeout   = 5 * time.Minute
	startTimeout   = 30 * time.Second
	defaultTimeout = 30 * time.Second
)

// requireEnv makes a missing outside tool a failure instead of a skip;
// CI sets it.
const requireEnv = "EXPERTD_E2E_REQUIRE"

var (
	buildOnce sync.Once
	buildDir  string
	buildPath string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// repoRoot is the module root (the tests run in e2e/).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// daemonBinary builds ./cmd/expertd once per test binary, as a user
// would, into a temporary directory.
func daemonBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "expertd-e2e-")
		if buildErr != nil {
			return
		}
		buildPath = filepath.Join(buildDir, "expertd")
		ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "go", "build", "-o", buildPath, "./cmd/expertd")
		cmd.Dir = repoRoot(t)
		start := time.Now()
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build ./cmd/expertd: %w\n%s", err, out)
			return
		}
		t.Logf("$ go build -o %s ./cmd/expertd  (%.1fs)", buildPath, time.Since(start).Seconds())
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildPath
}

// daemon is a running expertd process.
type daemon struct {
	// Addr is the gRPC address it serves on, "127.0.0.1:port".
	Addr string
	// Admin is the /metrics and /healthz address, empty unless the test
	// passed -admin-addr.
	Admin string
	cmd   *exec.Cmd
	logs  *servicetest.LogBuffer
	done  chan error
	// stopped makes stop idempotent: tests may stop a daemon before its
	// cleanup does.
	stopped sync.Once
	// sigterm, when set, delivers the SIGTERM of stop (a daemon started
	// through a container runtime gets it itself, not the runtime).
	sigterm func() error
}

// startDaemon starts the real daemon on a free loopback port (it binds
// :0 and logs the port, so no other process can take it first), waits
// until health reports SERVING, and stops it with SIGTERM at cleanup,
// checking that it drains and exits cleanly.
func startDaemon(t *testing.T, extra ...string) *daemon {
	t.Helper()
	d := startProcess(t, daemonBinary(t), daemonArgs(extra...))
	d.waitServing(t, time.After(startTimeout))
	t.Logf("expertd serving on %s", d.Addr)
	return d
}

// daemonArgs are the test daemon's flags: loopback, CPU backend, JSON logs
// at debug level (restart_test counts the calls' "finished call" lines,
// which successful calls log at debug).
func daemonArgs(extra ...string) []string {
	return append([]string{"-listen", "127.0.0.1:0", "-admin-addr", "", "-backend", "cpu",
		"-log-format", "json", "-log-level", "debug", "-max-tokens", "512", "-max-concurrent", "2"}, extra...)
}

// startProcess starts bin with args, a daemon or a command that runs one
// (a container), and returns once it logs its addresses, without waiting
// for health (a daemon loading a startup manifest is not SERVING yet).
func startProcess(t *testing.T, bin string, args []string) *daemon {
	t.Helper()
	t.Logf("$ %s %s", filepath.Base(bin), shellJoin(args))
	return startCmd(t, exec.Command(bin, args...))
}

// startCmd is startProcess for a command the caller set up (its
// environment, its directory).
func startCmd(t *testing.T, cmd *exec.Cmd) *daemon {
	t.Helper()
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", cmd.Path, err)
	}
	d := &daemon{cmd: cmd, logs: &servicetest.LogBuffer{}, done: make(chan error, 1)}

	addr := make(chan [2]string, 1)
	go func() {
		// Read the log for the bound address, then keep collecting it.
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			d.logs.Write([]byte(line + "\n"))
			var rec struct {
				Msg   string `json:"msg"`
				GRPC  string `json:"grpc"`
				Admin string `json:"admin"`
			}
			if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "expertd serving" {
				addr <- [2]string{rec.GRPC, rec.Admin}
			}
		}
		io.Copy(io.Discard, stderr)
		d.done <- cmd.Wait()
	}()
	t.Cleanup(func() { d.stop(t) })

	deadline := time.After(startTimeout)
	select {
	case a := <-addr:
		d.Addr, d.Admin = a[0], a[1]
	case err := <-d.done:
		d.done <- err
		t.Fatalf("expertd exited before serving: %v\nlog:\n%s", err, d.logs.String())
	case <-deadline:
		t.Fatalf("expertd did not report its address within %v\nlog:\n%s", startTimeout, d.logs.String())
	}
	return d
}

// waitServing polls the standard health service until SERVING.
func (d *daemon) waitServing(t *testing.T, deadline <-chan time.Time) {
	t.Helper()
	conn, err := grpc.NewClient(d.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "expertd.v1.ExpertService"})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return
		}
		select {
		case <-deadline:
			t.Fatalf("expertd on %s not SERVING within %v (last: %v %v)\nlog:\n%s", d.Addr, startTimeout, resp, err, d.logs.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// stop sends SIGTERM and expects a clean drain and exit status 0.
func (d *daemon) stop(t *testing.T) {
	d.stopped.Do(func() { d.terminate(t) })
}

func (d *daemon) terminate(t *testing.T) {
	if d.sigterm != nil {
		if err := d.sigterm(); err != nil {
			t.Errorf("SIGTERM: %v", err)
		}
	} else {
		d.cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck // it may have exited; done says how
	}
	select {
	case err := <-d.done:
		if err != nil {
			t.Errorf("expertd exited with %v after SIGTERM\nlog:\n%s", err, d.logs.String())
		} else if !strings.Contains(d.logs.String(), `"msg":"expertd stopped"`) {
			t.Errorf("expertd exited without logging its stop\nlog:\n%s", d.logs.String())
		}
	case <-time.After(15 * time.Second):
		d.cmd.Process.Kill()
		<-d.done
		t.Errorf("expertd did not exit within 15s of SIGTERM\nlog:\n%s", d.logs.String())
	}
}

// tool finds an outside program: $env, then the places
// scripts/e2e-setup.sh installs to (relative to the repo root), then
// $PATH. When it is absent the test fails under EXPERTD_E2E_REQUIRE and
// is skipped, loudly, otherwise.
func tool(t *testing.T, env, installed, name, what string, works func(path string) error) string {
	t.Helper()
	var candidates []string
	if p := os.Getenv(env); p != "" {
		candidates = append(candidates, p)
	} else {
		candidates = append(candidates, filepath.Join(repoRoot(t), installed))
		if p, err := exec.LookPath(name); err == nil {
			candidates = append(candidates, p)
		}
	}
	var why []string
	for _, p := range candidates {
		err := works(p)
		if err == nil {
			return p
		}
		why = append(why, fmt.Sprintf("%s: %v", p, err))
	}
	msg := fmt.Sprintf("%s is not available (tried $%s, %s, %s on $PATH: %s); run scripts/e2e-setup.sh", what, env, installed, name, strings.Join(why, "; "))
	if os.Getenv(requireEnv) != "" {
		t.Fatalf("%s is set: %s", requireEnv, msg)
	}
	t.Skipf("\n\n*** SKIPPING %s: %s ***\n*** set %s=1 to make this a failure ***\n\n", t.Name(), msg, requireEnv)
	return ""
}

// run executes a tool with a timeout and returns its stdout; stderr is in
// the error.
func run(t *testing.T, stdin io.Reader, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdin = stdin
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %w\nstderr:\n%s", filepath.Base(name), strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

// shellJoin writes args as a shell would need them, for the log.
func shellJoin(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = a
		if a == "" || strings.ContainsAny(a, " '\"$<>|&;*?{}") {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(q, " ")
}
