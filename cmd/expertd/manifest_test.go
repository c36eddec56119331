package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/kerneltest"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service/servicetest"
)

func TestParseManifest(t *testing.T) {
	two := 2
	tests := []struct {
		name    string
		in      string
		wantErr string
		check   func(t *testing.T, m *manifest)
	}{
		{"yaml", `
sets:
  - safetensors: {name: a, path: x/a.safetensors, layer: 3, preset: NAMING_PRESET_QWEN3_MOE, numExperts: 8}
  - safetensors:
      name: b
      path: b.safetensors
      weight_block_shape: [128, 128]
shard: {count: 4, placement: round-robin, index: 2}
waitForFiles: 90s
`, "", func(t *testing.T, m *manifest) {
			if len(m.Sets) != 2 || m.Sets[0].GetSafetensors().GetLayer() != 3 || m.Sets[0].GetSafetensors().GetNumExperts() != 8 ||
				!slices.Equal(m.Sets[1].GetSafetensors().GetWeightBlockShape(), []int32{128, 128}) {
				t.Errorf("sets = %v", m.Sets)
			}
			if m.Shard.Count != 4 || m.Shard.Placement != "round-robin" || *m.Shard.Index != two || m.WaitForFiles != 90*time.Second {
				t.Errorf("shard %+v, waitForFiles %v", m.Shard, m.WaitForFiles)
			}
		}},
		{"json", `{"sets": [{"safetensors": {"name": "a", "path": "a.safetensors", "preset": "NAMING_PRESET_NEMOTRON_H"}}]}`, "", nil},
		{"unknown key", "sets: [{safetensors: {name: a, path: a}}]\nshards: {count: 2}\n", `unknown field "shards"`, nil},
		{"unknown source field", "sets: [{safetensors: {name: a, pth: a}}]\n", `sets[0]: `, nil},
		{"upload header", "sets: [{header: {name: a}}]\n", "sets[0]: want a safetensors source", nil},
		{"duplicate name", "sets: [{safetensors: {name: a, path: a}}, {safetensors: {name: a, path: b}}]\n", `sets[1]: name "a" is also sets[0]'s`, nil},
		{"no sets", "shard: {count: 2}\n", "sets: at least one set is required", nil},
		{"bad placement", "sets: [{safetensors: {name: a, path: a}}]\nshard: {count: 2, placement: random}\n", `shard.placement "random"`, nil},
		{"bad count", "sets: [{safetensors: {name: a, path: a}}]\nshard: {count: 0}\n", "shard.count 0", nil},
		{"index out of range", "sets: [{safetensors: {name: a, path: a}}]\nshard: {count: 2, index: 2}\n", "shard.index 2: want in [0, 2)", nil},
		{"bad wait", "sets: [{safetensors: {name: a, path: a}}]\nwaitForFiles: soon\n", `waitForFiles "soon"`, nil},
		{"not yaml", "sets: [\n", "yaml", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := parseManifest([]byte(tt.in))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseManifest = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.check != nil {
				tt.check(t, m)
			}
		})
	}
}

func TestShardIndex(t *testing.T) {
	one := 1
	host := func(h string) func() (string, error) { return func() (string, error) { return h, nil } }
	tests := []struct {
		name     string
		sh       manifestShard
		flag     int
		hostname func() (string, error)
		want     int
		wantErr  string
	}{
		{"manifest wins", manifestShard{Count: 3, Index: &one}, 2, host("expertd-0"), 1, ""},
		{"flag", manifestShard{Count: 3}, 2, host("expertd-0"), 2, ""},
		{"host ordinal", manifestShard{Count: 3}, -1, host("expertd-shard-2"), 2, ""},
		{"host without ordinal", manifestShard{Count: 3}, -1, host("gpu-node"), 0, `host name "gpu-node" has no ordinal`},
		{"ordinal beyond count", manifestShard{Count: 3}, -1, host("expertd-3"), 0, "shard index 3: the manifest has 3 shards"},
		{"hostname error", manifestShard{Count: 3}, -1, func() (string, error) { return "", errors.New("no uts") }, 0, "no uts"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.sh.resolveIndex(tt.flag, tt.hostname)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("resolveIndex = %d, %v; want an error containing %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("resolveIndex = %d, %v; want %d", got, err, tt.want)
			}
		})
	}
}

func TestFormatVersion(t *testing.T) {
	bi := func(v string, settings ...string) *debug.BuildInfo {
		b := &debug.BuildInfo{Main: debug.Module{Version: v}}
		for i := 0; i < len(settings); i += 2 {
			b.Settings = append(b.Settings, debug.BuildSetting{Key: settings[i], Value: settings[i+1]})
		}
		return b
	}
	tests := []struct {
		name         string
		bi           *debug.BuildInfo
		ok           bool
		stampVersion string
		stampCommit  string
		want         string
	}{
		{"no build info", nil, false, "", "", "dev"},
		{"devel, no vcs", bi("(devel)"), true, "", "", "dev"},
		{"module version", bi("v1.4.0"), true, "", "", "v1.4.0"},
		{"vcs clean", bi("(devel)", "vcs.revision", "0123456789abcdef0123", "vcs.modified", "false"), true, "", "", "dev (commit 0123456789ab)"},
		{"vcs dirty", bi("(devel)", "vcs.revision", "0123456789abcdef0123", "vcs.modified", "true"), true, "", "", "dev (commit 0123456789ab, dirty)"},
		{"release stamp", bi("(devel)", "vcs.revision", "ffff", "vcs.modified", "true"), true, "v2.0.0", "abcdef", "v2.0.0 (commit abcdef)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			buildVersion, buildCommit = tt.stampVersion, tt.stampCommit
			defer func() { buildVersion, buildCommit = "", "" }()
			if got := formatVersion(tt.bi, tt.ok); got != tt.want {
				t.Errorf("formatVersion = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestVersionFlag(t *testing.T) {
	var out strings.Builder
	stdout = &out
	defer func() { stdout = os.Stdout }()
	if err := run(context.Background(), []string{"-version"}, func(string) string { return "" }, io.Discard, nil); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); !strings.HasPrefix(got, "expertd ") || !strings.Contains(got, version()) {
		t.Errorf("-version printed %q, want expertd %s", got, version())
	}
}

// smallShape is a layer small enough for the CPU backend in tests.
var smallShape = kerneltest.Shape{Name: "small", Activation: kernels.SiluGated, E: 8, TopK: 2, K: 64, N: 32,
	Scoring: kernels.Softmax, Renormalize: true, ScalingFactor: 1}

func probe(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// metricValue is the value of the first sample of name in a Prometheus
// text exposition, "" when absent.
func metricValue(body, name string) string {
	for _, line := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(line, name); ok && (strings.HasPrefix(rest, "{") || strings.HasPrefix(rest, " ")) {
			return rest[strings.LastIndexByte(rest, ' ')+1:]
		}
	}
	return ""
}

// TestManifestProbes starts the daemon with a manifest whose file is not
// there yet: it must be alive but not ready (HTTP and gRPC health) until
// the file appears and loads, then ready, with the set served and the
// progress in metrics; a drain makes it not ready again.
func TestManifestProbes(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	set, req := kerneltest.NewCase(rng, smallShape, 5, kerneltest.WithGranularity(scaling.PerExpert))
	staged := filepath.Join(t.TempDir(), "layer.safetensors")
	src, err := servicetest.WriteSafetensorsLayer(staged, set, 0)
	if err != nil {
		t.Fatal(err)
	}
	man := filepath.Join(t.TempDir(), "manifest.yaml")
	os.WriteFile(man, []byte(fmt.Sprintf(`sets:
  - safetensors: {name: layer0, path: sub/layer.safetensors, preset: %s, activation: %s,
                  w13_template: %q, w2_template: %q, w13_scale_template: %q, w2_scale_template: %q}
waitForFiles: 1m
`, src.Preset, src.Activation, src.W13Template, src.W2Template, src.W13ScaleTemplate, src.W2ScaleTemplate)), 0o644)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs servicetest.LogBuffer
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	args := []string{"-listen", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0", "-log-format", "json", "-backend", "cpu",
		"-weights-dir", dir, "-manifest", man, "-shutdown-timeout", "20s"}
	go func() { done <- run(ctx, args, func(string) string { return "" }, &logs, ready) }()
	var addrs listening
	select {
	case addrs = <-ready:
	case err := <-done:
		t.Fatalf("run exited early: %v\n%s", err, logs.String())
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon not listening")
	}
	conn, err := grpc.NewClient(addrs.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	healthOf := func() healthpb.HealthCheckResponse_ServingStatus {
		cctx, ccancel := context.WithTimeout(context.Background(), defaultTestTimeout)
		defer ccancel()
		resp, err := healthpb.NewHealthClient(conn).Check(cctx, &healthpb.HealthCheckRequest{Service: "expertd.v1.ExpertService"})
		if err != nil {
			t.Fatalf("health: %v", err)
		}
		return resp.GetStatus()
	}
	base := "http://" + addrs.admin
	// The file is missing, so the daemon waits: never ready meanwhile.
	for range 3 {
		if code, body := probe(t, base+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "loading the startup manifest: 1 sets pending") {
			t.Fatalf("/readyz before the load = %d %q, want 503 naming the pending set", code, body)
		}
		if code, _ := probe(t, base+"/livez"); code != http.StatusOK {
			t.Fatalf("/livez while loading = %d, want 200", code)
		}
		if st := healthOf(); st != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("gRPC health while loading = %v, want NOT_SERVING", st)
		}
		if _, body := probe(t, base+"/metrics"); metricValue(body, "expertd_manifest_sets_pending") != "1" {
			t.Fatalf("/metrics while loading lacks expertd_manifest_sets_pending 1")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// -probe, the image's HEALTHCHECK, agrees with the endpoints.
	noEnv := func(string) string { return "" }
	if err := run(context.Background(), []string{"-probe", base + "/livez"}, noEnv, io.Discard, nil); err != nil {
		t.Errorf("-probe /livez while loading: %v", err)
	}
	if err := run(context.Background(), []string{"-probe", base + "/readyz"}, noEnv, io.Discard, nil); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("-probe /readyz while loading = %v, want a 503 error", err)
	}
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	if err := os.Rename(staged, filepath.Join(dir, "sub", "layer.safetensors")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(defaultTestTimeout)
	for {
		code, body := probe(t, base+"/readyz")
		if code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz = %d %q %v after the file appeared\n%s", code, body, time.Since(deadline), logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if st := healthOf(); st != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("gRPC health after the load = %v, want SERVING", st)
	}
	_, metrics := probe(t, base+"/metrics")
	for name, want := range map[string]string{"expertd_manifest_sets_pending": "0", "expertd_manifest_sets_loaded_total": "1",
		"expertd_manifest_loaded_bytes_total": fmt.Sprint(set.Bytes())} {
		if got := metricValue(metrics, name); got != want {
			t.Errorf("/metrics: %s = %q, want %s", name, got, want)
		}
	}
	if !strings.Contains(logs.String(), `"msg":"startup manifest loaded"`) || !strings.Contains(logs.String(), `"msg":"waiting for a weights file"`) {
		t.Errorf("log lacks the manifest progress:\n%s", logs.String())
	}

	c, err := client.Dial(context.Background(), addrs.grpc)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cctx, ccancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer ccancel()
	res, err := c.FusedMoE(cctx, clienttest.Request("layer0", set, req))
	if err != nil {
		t.Fatalf("FusedMoE on the manifest's set: %v", err)
	}
	out, _ := res.Output.Float32s()
	want, _, _ := kerneltest.Reference(set, req)
	if e := kerneltest.RelL2(out, want); e > kerneltest.FP8Tol {
		t.Errorf("rel L2 %.3g against the reference, want <= %g", e, kerneltest.FP8Tol)
	}

	// Drain with a call in flight (an unfinished upload keeps it open).
	stream, err := pb.NewExpertServiceClient(conn).LoadExperts(cctx)
	if err != nil {
		t.Fatal(err)
	}
	f32t := func(v float32) *pb.Tensor { return tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(v), 1) }
	held := servicetest.Header("held", &pb.ExpertWeights{Activation: pb.Activation_ACTIVATION_SILU_GATED,
		W13:      tensor(pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, make([]byte, 32*16), 1, 32, 16),
		W2:       tensor(pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, make([]byte, 16*16), 1, 16, 16),
		W13Scale: f32t(1), W2Scale: f32t(1)}, false)
	if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Header_{Header: held}}); err != nil {
		t.Fatal(err)
	}
	cancel()
	deadline = time.Now().Add(defaultTestTimeout)
	for {
		code, body := probe(t, base+"/readyz")
		if code == http.StatusServiceUnavailable && strings.Contains(body, "draining") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz while draining = %d %q, want 503 draining", code, body)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if code, _ := probe(t, base+"/livez"); code != http.StatusOK {
		t.Errorf("/livez while draining = %d, want 200", code)
	}
	ccancel()
	if err := <-done; err != nil {
		t.Errorf("run: %v", err)
	}
}

// TestManifestFailure: a set that cannot load stops the start with an
// error naming it.
func TestManifestFailure(t *testing.T) {
	dir := t.TempDir()
	man := filepath.Join(dir, "m.json")
	os.WriteFile(man, []byte(`{"sets": [{"safetensors": {"name": "gone", "path": "missing.safetensors", "preset": "NAMING_PRESET_NEMOTRON_H"}}]}`), 0o644)
	var logs servicetest.LogBuffer
	err := run(context.Background(), []string{"-listen", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0", "-backend", "cpu", "-weights-dir", dir, "-manifest", man},
		func(string) string { return "" }, &logs, nil)
	if err == nil || !strings.Contains(err.Error(), `manifest sets[0]: expert set "gone"`) || !strings.Contains(err.Error(), "missing.safetensors") {
		t.Fatalf("run = %v, want a start failure naming the set and file", err)
	}
	err = run(context.Background(), []string{"-backend", "cpu", "-manifest", man}, func(string) string { return "" }, &logs, nil)
	if err == nil || !strings.Contains(err.Error(), "-weights-dir") {
		t.Fatalf("run without -weights-dir = %v, want an error naming it", err)
	}
}
