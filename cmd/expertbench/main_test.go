package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/clitest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

const defaultTestTimeout = 30 * time.Second

func startServer(t *testing.T) string {
	t.Helper()
	srv, err := testdaemon.Serve(service.Config{MaxConcurrent: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv.Addr
}

func runBench(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	var out, errOut bytes.Buffer
	err = run(ctx, args, &out, &errOut)
	return out.String(), errOut.String(), err
}

// TestBenchCalls loads a scaled layer of each model and runs a fixed
// number of calls: the summary must count exactly them, and the set must
// be gone afterwards.
func TestBenchCalls(t *testing.T) {
	addr := startServer(t)
	tests := []struct {
		model string
		sizes []string
	}{
		{"qwen3", []string{"-e", "8", "-k", "64", "-n", "32"}},
		{"nemotron", []string{"-e", "8", "-k", "48", "-n", "40"}},
		{"mixtral", []string{"-k", "32", "-n", "48"}},
		{"deepseek", []string{"-e", "16", "-k", "256", "-n", "128"}},
	}
	for _, tc := range tests {
		t.Run(tc.model, func(t *testing.T) {
			args := append([]string{"-addr", addr, "-model", tc.model, "-load", "-m", "3", "-c", "2", "-calls", "13", "-duration", "20s"}, tc.sizes...)
			stdout, stderr, err := runBench(t, args...)
			if err != nil {
				t.Fatalf("run: %v\nstderr:\n%s", err, stderr)
			}
			t.Logf("stdout:\n%s", stdout)
			if !regexp.MustCompile(`(?m)^calls +13 in `).MatchString(stdout) {
				t.Errorf("summary does not count 13 calls:\n%s", stdout)
			}
			for _, want := range []string{"model        " + tc.model + "/scaled", "backend      cpu", "tokens/call  3", "latency      p50 "} {
				if !strings.Contains(stdout, want) {
					t.Errorf("summary lacks %q:\n%s", want, stdout)
				}
			}
			if !strings.Contains(stderr, "loaded expertbench") {
				t.Errorf("stderr does not report the load:\n%s", stderr)
			}
		})
	}
	c, err := client.Dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if sets, err := c.ListExperts(context.Background()); err != nil || len(sets) != 0 {
		t.Errorf("after the runs ListExperts = %v, %v; want no sets (unloaded)", sets, err)
	}
}

// TestBenchDurationAndProgress runs by time with a fast progress ticker
// and a JSON summary.
func TestBenchDurationAndProgress(t *testing.T) {
	addr := startServer(t)
	start := time.Now()
	stdout, stderr, err := runBench(t, "-addr", addr, "-model", "qwen3", "-e", "8", "-k", "32", "-n", "16",
		"-load", "-m", "2", "-c", "3", "-duration", "400ms", "-progress", "100ms", "-json", "-no-rtt")
	if err != nil {
		t.Fatalf("run: %v\nstderr:\n%s", err, stderr)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("a 400ms run took %v", took)
	}
	var r result
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("parsing the JSON summary: %v\n%s", err, stdout)
	}
	if r.Calls < 1 || r.Elapsed < 400*time.Millisecond || r.P50 <= 0 || r.P50 > r.P99 || r.P99 > r.Max || r.Concurrency != 3 {
		t.Errorf("summary %+v: want calls, elapsed >= 400ms and 0 < p50 <= p99 <= max", r)
	}
	if got := float64(r.Calls*r.Tokens) / r.Elapsed.Seconds(); got != r.TokensPerS {
		t.Errorf("tokens/s %v, want calls*tokens/elapsed = %v", r.TokensPerS, got)
	}
	lines := regexp.MustCompile(`(?m)^\[ *\d+\.\ds\] +\d+ calls .* tokens/s +p50 .* p99 `).FindAllString(stderr, -1)
	if len(lines) < 2 {
		t.Errorf("want at least 2 progress lines on stderr, got %d:\n%s", len(lines), stderr)
	}
}

// TestBenchClockStartsAfterSetup: callers whose setup is slow (a GPU
// library opened, regions and rings registered) all get the whole
// -duration to call in, and the time spent setting them up is not part of
// the elapsed time tokens/s divides by.
func TestBenchClockStartsAfterSetup(t *testing.T) {
	addr := startServer(t)
	const setup = time.Second
	afterWorkerSetup = func() { time.Sleep(setup) }
	t.Cleanup(func() { afterWorkerSetup = func() {} })
	stdout, stderr, err := runBench(t, "-addr", addr, "-model", "qwen3", "-e", "8", "-k", "32", "-n", "16",
		"-load", "-m", "2", "-c", "2", "-duration", "300ms", "-json", "-no-rtt")
	if err != nil {
		t.Fatalf("run: %v\nstderr:\n%s", err, stderr)
	}
	var r result
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("parsing the JSON summary: %v\n%s", err, stdout)
	}
	// Two callers' setup takes 2 s; the run itself 300 ms and one call.
	if r.Elapsed < 300*time.Millisecond || r.Elapsed >= 2*setup {
		t.Errorf("elapsed %v: want the 300ms run without the callers' %v of setup", r.Elapsed, 2*setup)
	}
	if r.Calls < 2 {
		t.Errorf("%d calls: want both callers calling", r.Calls)
	}
}

// TestBenchFailsFast: calling a set that is not loaded ends the run with
// the server's error instead of a summary of failures.
func TestBenchFailsFast(t *testing.T) {
	addr := startServer(t)
	stdout, _, err := runBench(t, "-addr", addr, "-set", "absent", "-e", "8", "-k", "32", "-n", "16", "-calls", "5")
	if err == nil || !strings.Contains(err.Error(), "NotFound") {
		t.Errorf("run on an absent set = %v, want a NotFound error", err)
	}
	if stdout != "" {
		t.Errorf("a failed run printed a summary:\n%s", stdout)
	}
}

func TestFlags(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr string
	}{
		{[]string{"-addr", "10.1.2.3:50051"}, "not a loopback address"},
		{[]string{"-addr", "example.com:50051"}, "not a loopback address"},
		{[]string{"-addr", "[::1]:50051"}, ""},
		{[]string{"-addr", "localhost:1"}, ""},
		{[]string{"-addr", "10.1.2.3:50051", "-allow-remote"}, ""},
		{[]string{"-model", "gpt"}, `-model "gpt": want one of deepseek, mixtral, nemotron, qwen3`},
		{[]string{"-model", "deepseek", "-e", "12"}, "must divide E = 12"},
		{[]string{"-topk", "9", "-e", "8"}, "-topk 9: want 1..E (8)"},
		{[]string{"-duration", "2h"}, "want > 0 and <= 30m0s"},
		{[]string{"-calls", "-1"}, "-calls -1"},
		{[]string{"-c", "0"}, "-c 0"},
		{[]string{"-c", "2", "-conns", "3"}, "-conns 3: want 1..2 (-c)"},
		{[]string{"-conns", "0"}, "-conns 0"},
		{[]string{"-c", "4", "-conns", "4"}, ""},
		{[]string{"-m", "0"}, "-m 0"},
		{[]string{"-out", "fp8"}, `-out "fp8"`},
		{[]string{"-model", "deepseek", "-load"}, "is 10.50 GiB, above -max-load-gib 8"},
		{[]string{"-model", "deepseek", "-load", "-max-load-gib", "11"}, ""},
		{[]string{"-model", "deepseek"}, ""},
		{[]string{"-soak", "-bad-share", "1.5"}, "-bad-share 1.5"},
		{[]string{"-soak", "-check-share", "-0.1"}, "-check-share -0.1"},
		{[]string{"-soak", "-admin-addr", "10.1.2.3:9090"}, `-admin-addr "10.1.2.3:9090" is not a loopback`},
		{[]string{"-soak", "-admin-addr", "127.0.0.1:9090"}, ""},
		{[]string{"-timeout", "0s"}, "-timeout 0s: want > 0"},
		{[]string{"-scales", "fixed"}, `-scales "fixed": want dynamic or static`},
		{[]string{"-scales", "static"}, ""},
		{[]string{"-scales", "dynamic", "-model", "deepseek"}, ""},
		{[]string{"-scales", "static", "-model", "deepseek"}, "-scales static: deepseek is block-scaled"},
		{[]string{"-scales", "static", "-soak"}, "-scales static and -soak"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, err := parseFlags(tc.args, &bytes.Buffer{})
			if tc.wantErr == "" {
				if err != nil {
					t.Errorf("parseFlags = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("parseFlags = %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}

// TestRandomWeightsAreFinite: the table-driven generator must never emit
// a NaN code (0x7F, 0xFF), and should use both signs.
func TestRandomWeightsAreFinite(t *testing.T) {
	m := models["qwen3"]
	m.e, m.k, m.n = 4, 64, 32
	w := m.randomWeights(uint64(time.Now().UnixNano()))
	var neg, pos int
	for _, b := range append(w.W13.Data, w.W2.Data...) {
		if b&0x7F == 0x7F {
			t.Fatalf("NaN code %#x in the weights", b)
		}
		if b&0x80 != 0 {
			neg++
		} else if b != 0 {
			pos++
		}
	}
	if neg == 0 || pos == 0 {
		t.Errorf("%d negative and %d positive codes, want both", neg, pos)
	}
}

// TestSummarize: the breakdown's medians and the per-call differences
// that no single clock measures.
func TestSummarize(t *testing.T) {
	ms := time.Millisecond
	call := func(latency, receive, total, kernel time.Duration, req, resp int) callSample {
		return callSample{latency: latency, send: ms / 10, reqBytes: req, respBytes: resp,
			server: client.Timings{Receive: receive, Decode: ms / 100, Kernel: kernel, Total: total}}
	}
	calls := []callSample{
		call(12*ms, ms, 11*ms, 10*ms, 100, 50),
		call(30*ms, 2*ms, 20*ms, 10*ms, 100, 50), // a slow call: its own differences, not the medians'
		call(11*ms, ms, 10*ms, 10*ms, 120, 60),
	}
	got := summarize(calls)
	want := breakdown{
		Client: 12 * ms, Send: ms / 10, Receive: ms, Decode: ms / 100, Kernel: 10 * ms, Total: 11 * ms,
		RPC: ms, Service: ms, OverheadPct: 20, RequestBytes: 100, ResponseBytes: 50,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("summarize (-want +got):\n%s", diff)
	}
}

// TestBenchStream runs the calls over FusedMoEStreams, with one and with
// several in flight, over TCP and over a Unix socket, and checks the
// count, the mode line, the round trips and the trace file.
func TestBenchStream(t *testing.T) {
	tcp := startServer(t)
	dir, err := os.MkdirTemp("", "expertbench")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "expertd.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	svc := service.New(service.Config{MaxConcurrent: 2}, cpu.New(kernels.Config{}), nil)
	var conns connCounter
	gs := grpc.NewServer(append(svc.ServerOptions(), grpc.StatsHandler(&conns))...)
	svc.Register(gs)
	healthpb.RegisterHealthServer(gs, health.NewServer())
	go gs.Serve(lis) //nolint:errcheck // returns when stopped
	t.Cleanup(gs.Stop)

	for _, tc := range []struct {
		name, addr string
		args       []string
		mode       string
	}{
		{"stream", tcp, []string{"-stream"}, "FusedMoEStream, 1 in flight per caller"},
		{"inflight", tcp, []string{"-inflight", "3"}, "FusedMoEStream, 3 in flight per caller"},
		{"unix unary", "unix://" + sock, nil, "unary FusedMoE"},
		{"unix inflight", "unix:" + sock, []string{"-inflight", "2"}, "FusedMoEStream, 2 in flight per caller"},
		{"unix conns", "unix:" + sock, []string{"-conns", "2"}, "unary FusedMoE, 2 connections"},
		{"unix conns stream", "unix:" + sock, []string{"-conns", "2", "-stream"}, "FusedMoEStream, 1 in flight per caller, 2 connections"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := conns.n.Load()
			traceFile := filepath.Join(t.TempDir(), "trace.out")
			args := append([]string{"-addr", tc.addr, "-model", "qwen3", "-e", "8", "-k", "64", "-n", "32", "-load", "-m", "3", "-c", "2",
				"-calls", "13", "-duration", "20s", "-trace", traceFile}, tc.args...)
			stdout, stderr, err := runBench(t, args...)
			if err != nil {
				t.Fatalf("run: %v\nstderr:\n%s", err, stderr)
			}
			for _, re := range []string{`(?m)^calls +13 in `, `(?m)^mode +` + regexp.QuoteMeta(tc.mode) + `$`,
				`(?m)^rtt +bare grpc-go p50 [0-9.]+ ms .* daemon health p50 [0-9.]+ ms`, `(?m)^server +kernel p50 [0-9.]+ ms +total p50 [0-9.]+ ms`} {
				if !regexp.MustCompile(re).MatchString(stdout) {
					t.Errorf("summary does not match %s:\n%s", re, stdout)
				}
			}
			if fi, err := os.Stat(traceFile); err != nil || fi.Size() == 0 {
				t.Errorf("-trace file: %v, %v; want a trace", fi, err)
			}
			if tc.addr != tcp {
				want := int64(1)
				if slices.Contains(tc.args, "-conns") {
					want = 2
				}
				if got := conns.n.Load() - before; got != want {
					t.Errorf("the run opened %d connections, want %d", got, want)
				}
			}
		})
	}
}

// connCounter is a stats.Handler counting the connections a server saw.
type connCounter struct{ n atomic.Int64 }

func (c *connCounter) HandleConn(_ context.Context, s stats.ConnStats) {
	if _, ok := s.(*stats.ConnBegin); ok {
		c.n.Add(1)
	}
}

func (*connCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (*connCounter) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

func (*connCounter) HandleRPC(context.Context, stats.RPCStats) {}

// stalled answers health checks but holds every FusedMoE call until the
// caller gives up: a daemon whose backend hangs.
type stalled struct {
	pb.UnimplementedExpertServiceServer
}

func (stalled) FusedMoE(ctx context.Context, _ *pb.FusedMoERequest) (*pb.FusedMoEResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestTimeout: -timeout bounds the dial (a peer that accepts TCP and never
// answers) and each call (a daemon that holds it).
func TestTimeout(t *testing.T) {
	_, _, err := runBench(t, "-addr", clitest.SilentPeer(t), "-timeout", "300ms", "-e", "8", "-k", "32", "-n", "16", "-calls", "1")
	if err == nil || !strings.Contains(err.Error(), "within -timeout 300ms") {
		t.Errorf("run against a silent peer = %v, want an error naming -timeout", err)
	}

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	pb.RegisterExpertServiceServer(gs, stalled{})
	go gs.Serve(lis)
	defer gs.Stop()
	stdout, _, err := runBench(t, "-addr", lis.Addr().String(), "-timeout", "300ms", "-e", "8", "-k", "32", "-n", "16", "-calls", "1")
	if err == nil || (status.Code(errors.Unwrap(err)) != codes.DeadlineExceeded && !strings.Contains(err.Error(), "DeadlineExceeded")) {
		t.Errorf("run against a stalled daemon = %v, want DeadlineExceeded", err)
	}
	if stdout != "" {
		t.Errorf("a failed run printed a summary:\n%s", stdout)
	}
}

// TestUsageLinesBounded: a megabyte flag value reaches stderr in lines of
// at most clip.Line bytes.
func TestUsageLinesBounded(t *testing.T) {
	var stderr bytes.Buffer
	if _, err := parseFlags([]string{"-m", strings.Repeat("9", 1<<20) + "x"}, &stderr); err == nil {
		t.Fatal("parseFlags accepted a megabyte -m")
	}
	clitest.CheckLines(t, stderr.String())
}
