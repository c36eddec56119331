package main

import (
	"context"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/service/servicetest"
)

// TestListenAddress: -listen's unix forms are gRPC's target syntax.
func TestListenAddress(t *testing.T) {
	tests := []struct {
		listen, network, address string
		wantErr                  bool
	}{
		{listen: "127.0.0.1:50051", network: "tcp", address: "127.0.0.1:50051"},
		{listen: ":0", network: "tcp", address: ":0"},
		{listen: "unix:///run/expertd/expertd.sock", network: "unix", address: "/run/expertd/expertd.sock"},
		{listen: "unix:/run/expertd.sock", network: "unix", address: "/run/expertd.sock"},
		{listen: "unix:expertd.sock", network: "unix", address: "expertd.sock"},
		{listen: "unix://relative.sock", wantErr: true},
		{listen: "unix:", wantErr: true},
		{listen: "unix://", wantErr: true},
	}
	for _, tt := range tests {
		network, address, err := listenAddress(tt.listen)
		if (err != nil) != tt.wantErr || network != tt.network || address != tt.address {
			t.Errorf("listenAddress(%q) = %q, %q, %v; want %q, %q, error %v", tt.listen, network, address, err, tt.network, tt.address, tt.wantErr)
		}
	}
	if _, err := parseConfig([]string{"-listen", "unix://x.sock"}, func(string) string { return "" }, &strings.Builder{}); err == nil || !strings.Contains(err.Error(), "-listen") {
		t.Errorf("parseConfig(-listen unix://x.sock) = %v, want an error naming -listen", err)
	}
	if _, err := parseConfig([]string{"-unix-mode", "0999"}, func(string) string { return "" }, &strings.Builder{}); err == nil || !strings.Contains(err.Error(), "-unix-mode") {
		t.Errorf("parseConfig(-unix-mode 0999) = %v, want an error naming -unix-mode", err)
	}
}

// socketPath is a fresh socket path short enough for sun_path (108
// bytes), which a test's TempDir under a long TMPDIR may not be.
func socketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "expertd-sock")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "expertd.sock")
}

// daemon is a running run() that a test stops itself.
type daemon struct {
	addr string
	logs *servicetest.LogBuffer
	stop func() error
}

// startUnixDaemon runs the daemon on args (which choose -listen); stop
// cancels it and returns run's error.
func startUnixDaemon(t *testing.T, args ...string) (*daemon, error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logs := &servicetest.LogBuffer{}
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	args = append([]string{"-admin-addr", "", "-backend", "cpu", "-threads", "2", "-log-format", "json"}, args...)
	go func() { done <- run(ctx, args, func(string) string { return "" }, logs, ready) }()
	stopped := false
	stop := func() error {
		cancel()
		if stopped {
			return nil
		}
		stopped = true
		select {
		case err := <-done:
			return err
		case <-time.After(defaultTestTimeout):
			t.Error("daemon did not stop")
			return nil
		}
	}
	t.Cleanup(func() { stop() })
	select {
	case a := <-ready:
		return &daemon{addr: a.grpc, logs: logs, stop: stop}, nil
	case err := <-done:
		stopped = true
		cancel()
		return &daemon{logs: logs, stop: stop}, err
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon not ready")
	}
	return nil, nil
}

// TestUnixSocket serves on a Unix socket: the file has -unix-mode's
// permissions, the SDK dials the -listen string itself and runs a layer
// with tensors inline and in shared memory (a Unix peer is local), and
// the file is gone once the daemon exits.
func TestUnixSocket(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		want os.FileMode
	}{
		{"default mode", nil, 0o660},
		{"-unix-mode 0600", []string{"-unix-mode", "0600"}, 0o600},
		{"-unix-mode 0666", []string{"-unix-mode", "666"}, 0o666},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := socketPath(t)
			listen := "unix://" + path
			d, err := startUnixDaemon(t, append([]string{"-listen", listen, "-shared-memory"}, tt.args...)...)
			if err != nil {
				t.Fatalf("run: %v\n%s", err, d.logs.String())
			}
			fi, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != tt.want {
				t.Errorf("socket file mode %v, want a socket with %v", fi.Mode(), tt.want)
			}
			if strings.Contains(d.logs.String(), "reachable from other hosts") {
				t.Errorf("a Unix socket is reported as reachable from other hosts:\n%s", d.logs.String())
			}
			callOverSocket(t, listen)
			if err := d.stop(); err != nil {
				t.Fatalf("run: %v", err)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Errorf("socket file after exit: %v, want it removed", err)
			}
		})
	}
}

// callOverSocket runs a small layer over the socket at target: inline,
// then with hidden states, logits and the output in shared memory.
func callOverSocket(t *testing.T, target string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	// A bearer token is refused in plaintext except to a local target:
	// Dial accepting it shows the SDK counts the socket as local.
	c, err := client.Dial(ctx, target, client.WithBearerToken("unused-without-auth-tokens-file"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
	const e, k, n, m = 4, 32, 16, 3
	w := relu2Weights(rng, k, n)
	if _, err := c.LoadExperts(ctx, "layer0", w); err != nil {
		t.Fatalf("LoadExperts: %v", err)
	}
	hidden := client.FromFloat32(randF32(rng, m*k), m, k)
	logits := client.FromFloat32(randF32(rng, m*e), m, e)
	inline, err := c.FusedMoE(ctx, &client.FusedMoERequest{
		ExpertSet: "layer0", Hidden: hidden, RouterLogits: logits,
		Routing: client.Routing{TopK: 2}, OutputDType: moe.Float32,
	})
	if err != nil {
		t.Fatalf("FusedMoE inline: %v", err)
	}
	want, _ := inline.Output.Float32s()

	shm, err := client.CreateSharedMemory("", 1<<16)
	if err != nil {
		t.Skipf("no POSIX shared memory: %v", err)
	}
	defer shm.Close()
	region, err := c.RegisterSharedMemory(ctx, "acts", shm, 0, shm.Size())
	if err != nil {
		t.Fatalf("RegisterSharedMemory over a Unix socket: %v", err)
	}
	shm.Unlink()
	sh, err := region.Put(0, hidden)
	if err != nil {
		t.Fatal(err)
	}
	sl, err := region.Put(4096, logits)
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.FusedMoE(ctx, &client.FusedMoERequest{
		ExpertSet: "layer0", Hidden: sh, RouterLogits: sl,
		Routing: client.Routing{TopK: 2}, OutputDType: moe.Float32,
		OutputShm: region.Ref(8192, m*k*4),
	})
	if err != nil {
		t.Fatalf("FusedMoE through shared memory: %v", err)
	}
	got, err := res.Output.Float32s()
	if err != nil || len(got) != len(want) {
		t.Fatalf("shm output: %d values, %v; want %d", len(got), err, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("shm output[%d] = %v, inline %v: the same call must give the same numbers", i, got[i], want[i])
		}
	}
}

// TestUnixSocketStale: a socket file nobody serves on (a daemon that
// died) is replaced; a regular file, or a socket another process serves
// on, is left alone and the daemon refuses to start, naming the path.
func TestUnixSocketStale(t *testing.T) {
	t.Run("stale socket", func(t *testing.T) {
		path := socketPath(t)
		l, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close() // the file stays, as after a SIGKILL
		d, err := startUnixDaemon(t, "-listen", "unix:"+path, "-shared-memory")
		if err != nil {
			t.Fatalf("run over a stale socket: %v\n%s", err, d.logs.String())
		}
		if !strings.Contains(d.logs.String(), "removing a stale socket file") {
			t.Errorf("no log line about the stale socket:\n%s", d.logs.String())
		}
		callOverSocket(t, d.addr)
	})
	t.Run("regular file", func(t *testing.T) {
		path := socketPath(t)
		if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
			t.Fatal(err)
		}
		d, err := startUnixDaemon(t, "-listen", "unix:"+path)
		if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "not a socket") {
			t.Errorf("run over a regular file = %v, want an error naming %s as not a socket\n%s", err, path, d.logs.String())
		}
		if b, err := os.ReadFile(path); err != nil || string(b) != "keep me" {
			t.Errorf("the regular file: %q, %v; want it untouched", b, err)
		}
	})
	t.Run("live socket", func(t *testing.T) {
		path := socketPath(t)
		l, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		d, err := startUnixDaemon(t, "-listen", "unix:"+path)
		if err == nil || !strings.Contains(err.Error(), "another process is serving") {
			t.Errorf("run over a live socket = %v, want a refusal\n%s", err, d.logs.String())
		}
		if _, err := os.Lstat(path); err != nil {
			t.Errorf("the live socket: %v, want it kept", err)
		}
	})
}

// TestStreamWorkers: a daemon with a handler pool serves calls, and the
// flag's range is checked.
func TestStreamWorkers(t *testing.T) {
	d, err := startUnixDaemon(t, "-listen", "unix:"+socketPath(t), "-shared-memory", "-stream-workers", "2")
	if err != nil {
		t.Fatalf("run: %v\n%s", err, d.logs.String())
	}
	callOverSocket(t, d.addr)
	for _, bad := range []string{"-1", "1025"} {
		if _, err := parseConfig([]string{"-stream-workers", bad}, func(string) string { return "" }, &strings.Builder{}); err == nil || !strings.Contains(err.Error(), "-stream-workers") {
			t.Errorf("-stream-workers %s: %v, want an error naming the flag", bad, err)
		}
	}
}
