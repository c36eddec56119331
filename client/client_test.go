package client_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/internal/testdaemon"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
)

// defaultTestTimeout bounds every call of these tests.
const defaultTestTimeout = 10 * time.Second

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	t.Cleanup(cancel)
	return ctx
}

// startServer serves cfg in-process and returns a client dialed to it.
func startServer(t *testing.T, cfg service.Config, opts ...client.Option) *client.Client {
	t.Helper()
	srv, err := testdaemon.Serve(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	c, err := client.Dial(testContext(t), srv.Addr, opts...)
	if err != nil {
		t.Fatalf("Dial(%s) = %v", srv.Addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// checkOutput compares a result with the float64 reference of the case.
func checkOutput(t *testing.T, res *client.FusedMoEResult, set *moe.ExpertSet, req *moe.Request) {
	t.Helper()
	got, err := res.Output.Float32s()
	if err != nil {
		t.Fatalf("output: %v", err)
	}
	if want := []int{req.M(), set.K}; fmt.Sprint(res.Output.Shape) != fmt.Sprint(want) {
		t.Fatalf("output shape %v, want %v", res.Output.Shape, want)
	}
	want, _, _ := kerneltest.Reference(set, req)
	if e := kerneltest.RelL2(got, want); e > 2e-2 {
		t.Errorf("relative L2 error %.3g against the float64 reference, want <= 2e-2", e)
	}
}

// TestFusedMoEMatchesReference runs scaled reference shapes through a
// loaded set and inline weights and checks every output.
func TestFusedMoEMatchesReference(t *testing.T) {
	rng := newRand(t)
	c := startServer(t, service.Config{})
	// DeepSeek-V3's routing (groups, bias, block scales) on fewer experts.
	ds := kerneltest.DeepSeekV3.Scaled(128, 64)
	ds.E, ds.NumGroups, ds.TopKGroups, ds.TopK = 16, 4, 2, 4
	tests := []struct {
		name  string
		shape kerneltest.Shape
		m     int
		opts  []kerneltest.Option
	}{
		{"qwen3 fp32 out", kerneltest.Qwen3.Scaled(64, 48), 5, []kerneltest.Option{kerneltest.WithOutput(moe.Float32)}},
		{"nemotron relu2 bf16 out", kerneltest.Nemotron.Scaled(48, 40), 3, nil},
		{"deepseek block fp8 hidden", ds, 2,
			[]kerneltest.Option{kerneltest.WithBlock(64, 64), kerneltest.WithHidden(moe.Float8E4M3FN), kerneltest.WithOutput(moe.Float32)}},
		{"mixtral precomputed", kerneltest.Mixtral.Scaled(32, 64), 1, []kerneltest.Option{kerneltest.WithPrecomputedRouting()}},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testContext(t)
			set, req := kerneltest.NewCase(rng, tc.shape, tc.m, tc.opts...)
			name := fmt.Sprintf("set%d", i)
			info, err := c.LoadExperts(ctx, name, clienttest.Weights(set), client.ChunkBytes(1000))
			if err != nil {
				t.Fatalf("LoadExperts: %v", err)
			}
			if info.NumExperts != set.E || info.HiddenSize != set.K || info.IntermediateSize != set.N {
				t.Errorf("info E,K,N = %d,%d,%d, want %d,%d,%d", info.NumExperts, info.HiddenSize, info.IntermediateSize, set.E, set.K, set.N)
			}
			r := clienttest.Request(name, set, req)
			r.ReturnRouting = true
			res, err := c.FusedMoE(ctx, r)
			if err != nil {
				t.Fatalf("FusedMoE: %v", err)
			}
			checkOutput(t, res, set, req)
			if res.Backend != "cpu" {
				t.Errorf("backend %q, want cpu", res.Backend)
			}
			if res.Timings.Total <= 0 {
				t.Errorf("timings.Total = %v, want > 0", res.Timings.Total)
			}
			ids, err := res.TopKIDs.Int32s()
			if err != nil || len(ids) != tc.m*tc.shape.TopK {
				t.Errorf("returned topk_ids: %d ids, %v; want %d", len(ids), err, tc.m*tc.shape.TopK)
			}

			// The same call with the weights inline.
			r.ExpertSet, r.Weights = "", clienttest.Weights(set)
			res, err = c.FusedMoE(ctx, r)
			if err != nil {
				t.Fatalf("FusedMoE inline: %v", err)
			}
			checkOutput(t, res, set, req)
		})
	}
}

// randomCodes is n FP8 E4M3FN codes of random finite values.
func randomCodes(t *testing.T, n int) []byte {
	rng := newRand(t)
	b := make([]byte, n)
	for i := range b {
		b[i] = scaling.Float32ToE4M3(float32(rng.NormFloat64()))
	}
	return b
}

// TestLoadExpertsChunks uploads a set larger than the server's message
// limit: it must arrive in chunks, with monotone progress, and the
// server's fingerprint must be the SHA-256 of the bytes.
func TestLoadExpertsChunks(t *testing.T) {
	const e, k, n = 4, 512, 256 // w13 1 MiB, w2 512 KiB
	c := startServer(t, service.Config{MaxMessageBytes: 1 << 20})
	w := &client.ExpertWeights{
		Activation: moe.SiluGated,
		W13:        client.FromFP8(randomCodes(t, e*2*n*k), e, 2*n, k),
		W2:         client.FromFP8(randomCodes(t, e*k*n), e, k, n),
		W13Scale:   client.FromFloat32([]float32{0.01, 0.02, 0.03, 0.04}, e),
		W2Scale:    client.FromFloat32([]float32{0.02}),
	}
	total := int64(len(w.W13.Data) + len(w.W2.Data) + 4*4 + 4)
	ctx := testContext(t)

	if _, err := c.LoadExperts(ctx, "whole", w, client.ChunkBytes(4<<20)); status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "-max-message-bytes") {
		t.Errorf("LoadExperts in one 1.5 MiB chunk = %v, want ResourceExhausted from the 1 MiB limit, naming -max-message-bytes", err)
	}

	var seen []client.Progress
	info, err := c.LoadExperts(ctx, "chunked", w, client.ChunkBytes(256<<10),
		client.OnProgress(func(p client.Progress) { seen = append(seen, p) }))
	if err != nil {
		t.Fatalf("LoadExperts chunked: %v", err)
	}
	// 4 + 2 chunks of 256 KiB and one per scale, after the initial report.
	if got, want := len(seen), 1+4+2+2; got != want {
		t.Errorf("progress reported %d times, want %d", got, want)
	}
	for i, p := range seen {
		if p.TotalBytes != total || (i > 0 && p.SentBytes <= seen[i-1].SentBytes) {
			t.Errorf("progress[%d] = %+v after %+v: want increasing SentBytes of %d", i, p, seen[max(i-1, 0)], total)
		}
	}
	if last := seen[len(seen)-1]; last.SentBytes != total {
		t.Errorf("last progress %d bytes, want %d", last.SentBytes, total)
	}
	h := sha256.New()
	for _, b := range [][]byte{w.W13.Data, w.W2.Data, w.W13Scale.Data, w.W2Scale.Data} {
		h.Write(b)
	}
	if want := hex.EncodeToString(h.Sum(nil)); info.Fingerprint != want {
		t.Errorf("fingerprint %s, want %s", info.Fingerprint, want)
	}
	if info.Bytes != total || info.W13ScaleGranularity != "per-expert" || info.W2ScaleGranularity != "per-tensor" {
		t.Errorf("info = %+v, want %d bytes, per-expert w13 and per-tensor w2 scales", info, total)
	}

	if _, err := c.LoadExperts(ctx, "chunked", w); status.Code(err) != codes.AlreadyExists {
		t.Errorf("second load of the same name = %v, want AlreadyExists", err)
	}
	if _, err := c.LoadExperts(ctx, "chunked", w, client.Overwrite()); err != nil {
		t.Errorf("load with Overwrite = %v", err)
	}
	sets, err := c.ListExperts(ctx)
	if err != nil || len(sets) != 1 || sets[0].Name != "chunked" || sets[0].LoadedAt.IsZero() {
		t.Errorf("ListExperts = %+v, %v; want the one set \"chunked\" with a load time", sets, err)
	}
	freed, err := c.UnloadExperts(ctx, "chunked")
	if err != nil || freed != total {
		t.Errorf("UnloadExperts = %d, %v; want %d", freed, err, total)
	}
	if _, err := c.UnloadExperts(ctx, "chunked"); status.Code(err) != codes.NotFound {
		t.Errorf("second UnloadExperts = %v, want NotFound", err)
	}
}

// TestErrors checks that local refusals and server statuses both reach
// the caller with their code, the method and the field named.
func TestErrors(t *testing.T) {
	c := startServer(t, service.Config{})
	ctx := testContext(t)
	hidden := client.FromFloat32(make([]float32, 2*32), 2, 32)
	tests := []struct {
		name     string
		req      *client.FusedMoERequest
		wantCode codes.Code
		wantMsg  string
	}{
		{"unknown set", &client.FusedMoERequest{ExpertSet: "nope", Hidden: hidden,
			RouterLogits: client.FromFloat32(make([]float32, 8), 2, 4), Routing: client.Routing{TopK: 1}}, codes.NotFound, "nope"},
		{"short hidden", &client.FusedMoERequest{ExpertSet: "x", Hidden: client.FromFloat32(make([]float32, 3), 2, 2)},
			codes.InvalidArgument, "hidden_states: float32 shape [2 2] needs 16 bytes, got 12"},
		{"no experts", &client.FusedMoERequest{Hidden: hidden}, codes.InvalidArgument, "ExpertSet"},
		{"no hidden", &client.FusedMoERequest{ExpertSet: "x"}, codes.InvalidArgument, "hidden_states: required"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.FusedMoE(ctx, tc.req)
			if status.Code(err) != tc.wantCode || !strings.Contains(err.Error(), tc.wantMsg) || !strings.Contains(err.Error(), "FusedMoE") {
				t.Errorf("FusedMoE = %v, want %v naming FusedMoE and %q", err, tc.wantCode, tc.wantMsg)
			}
		})
	}
}

func TestServerInfoAndHealth(t *testing.T) {
	c := startServer(t, service.Config{MaxTokens: 77, MaxConcurrent: 3, Version: "test-1", BatchWindow: time.Millisecond, BatchMaxTokens: 9,
		StreamWorkers: 2, KeepaliveTime: time.Minute, MaxConnectionAgeGrace: time.Second, Settings: map[string]string{"threads": "2"}})
	ctx := testContext(t)
	info, err := c.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Limits.MaxQueued != 12 || info.Limits.BatchWindow != time.Millisecond || info.Limits.BatchMaxTokens != 9 ||
		info.Transport != (client.Transport{StreamWorkers: 2, KeepaliveTime: time.Minute, MaxConnectionAgeGrace: time.Second}) || info.Settings["threads"] != "2" {
		t.Errorf("ServerInfo limits %+v, transport %+v, settings %v: want what the server was configured with", info.Limits, info.Transport, info.Settings)
	}
	if info.Version != "test-1" || info.Limits.MaxTokens != 77 || info.Limits.MaxConcurrent != 3 ||
		info.Limits.MaxMessageBytes != testdaemon.MaxMessageBytes || len(info.Backends) == 0 || info.Backends[0].Name != "cpu" {
		t.Errorf("ServerInfo = %+v", info)
	}
	if err := c.Health(ctx); err != nil {
		t.Errorf("Health = %v", err)
	}
}

// TestDialHonorsContext: nothing listens, so Dial gives up when ctx ends.
func TestDialHonorsContext(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	c, err := client.Dial(ctx, addr)
	if err == nil {
		c.Close()
		t.Fatalf("Dial(%s) with nothing listening: no error", addr)
	}
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Errorf("Dial = %v after %v, want DeadlineExceeded after about 200ms", err, time.Since(start))
	}
}
