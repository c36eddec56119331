package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service/servicetest"
)

// httpGet returns the status and body of GET url.
func httpGet(t *testing.T, url string) (int, string) {
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

// TestProbesAndManifest runs the real daemon with a startup manifest whose
// weights file appears only later (as a sidecar would write it): the
// process is alive but not ready, over HTTP and gRPC health, until the set
// is loaded; then ready and serving the set; then, draining on SIGTERM
// with a call in flight, not ready again while still alive.
func TestProbesAndManifest(t *testing.T) {
	weights := t.TempDir()
	set, req := kerneltest.NewCase(newRand(t), kerneltest.Shape{Name: "probes", Activation: moe.Relu2, E: 6, TopK: 2, K: 64, N: 48,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}, 7, kerneltest.WithGranularity(scaling.PerExpert))
	staged := filepath.Join(t.TempDir(), "layer.safetensors")
	src, err := servicetest.WriteSafetensorsLayer(staged, set, 4)
	if err != nil {
		t.Fatal(err)
	}
	manifest := filepath.Join(t.TempDir(), "manifest.yaml")
	os.WriteFile(manifest, []byte(fmt.Sprintf(`# loaded before the daemon reports ready
sets:
  - safetensors:
      name: layer4
      path: ckpt/layer.safetensors
      layer: 4
      preset: %s
      activation: %s
      w13_template: %q
      w2_template: %q
      w13_scale_template: %q
      w2_scale_template: %q
waitForFiles: 2m
`, src.Preset, src.Activation, src.W13Template, src.W2Template, src.W13ScaleTemplate, src.W2ScaleTemplate)), 0o644)

	d := startProcess(t, daemonBinary(t), daemonArgs("-admin-addr", "127.0.0.1:0", "-weights-dir", weights, "-manifest", manifest, "-shutdown-timeout", "30s"))
	admin := "http://" + d.Admin
	conn, err := grpc.NewClient(d.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := func() healthpb.HealthCheckResponse_ServingStatus {
		ctx, cancel := context.WithTimeout(context.Background(), defaultTimeout)
		defer cancel()
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			t.Fatalf("health: %v", err)
		}
		return resp.GetStatus()
	}

	for range 3 {
		if code, body := httpGet(t, admin+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "1 sets pending") {
			t.Fatalf("/readyz before the load: %d %q, want 503 with the pending count", code, body)
		}
		if code, _ := httpGet(t, admin+"/livez"); code != http.StatusOK {
			t.Fatalf("/livez while loading: %d, want 200", code)
		}
		if code, _ := httpGet(t, admin+"/healthz"); code != http.StatusOK {
			t.Fatalf("/healthz (unchanged: alive and not draining) while loading: %d, want 200", code)
		}
		if st := health(); st != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("gRPC health while loading: %v, want NOT_SERVING", st)
		}
		if _, body := httpGet(t, admin+"/metrics"); metricValue(body, "expertd_manifest_sets_pending") != "1" {
			t.Fatalf("/metrics while loading: expertd_manifest_sets_pending = %q, want 1", metricValue(body, "expertd_manifest_sets_pending"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	// -probe, the image's HEALTHCHECK, agrees with the endpoints.
	bin := daemonBinary(t)
	if _, err := run(t, nil, bin, "-probe", admin+"/livez"); err != nil {
		t.Errorf("expertd -probe /livez while loading: %v", err)
	}
	if _, err := run(t, nil, bin, "-probe", admin+"/readyz"); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("expertd -probe /readyz while loading = %v, want exit 1 naming the 503", err)
	}
	os.Mkdir(filepath.Join(weights, "ckpt"), 0o755)
	if err := os.Rename(staged, filepath.Join(weights, "ckpt", "layer.safetensors")); err != nil {
		t.Fatal(err)
	}
	d.waitServing(t, time.After(startTimeout))
	if code, body := httpGet(t, admin+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz after the load: %d %q", code, body)
	}
	if !strings.Contains(d.logs.String(), `"msg":"startup manifest loaded"`) {
		t.Errorf("no load progress in the log:\n%s", d.logs.String())
	}

	_, metrics := httpGet(t, admin+"/metrics")
	for name, want := range map[string]string{"expertd_manifest_sets_pending": "0", "expertd_manifest_sets_loaded_total": "1",
		"expertd_manifest_loaded_bytes_total": fmt.Sprint(set.Bytes())} {
		if got := metricValue(metrics, name); got != want {
			t.Errorf("/metrics: %s = %q, want %s", name, got, want)
		}
	}

	ctx := testContext(t)
	c, err := client.Dial(ctx, d.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res, err := c.FusedMoE(ctx, clienttest.Request("layer4", set, req))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := res.Output.Float32s()
	checkAgainstReference(t, "FusedMoE on the manifest's set", got, set, req)

	// An upload left open is a call in flight: the drain waits for it.
	streamCtx, streamCancel := context.WithCancel(context.Background())
	defer streamCancel()
	stream, err := pb.NewExpertServiceClient(conn).LoadExperts(streamCtx)
	if err != nil {
		t.Fatal(err)
	}
	f32 := &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{1}}
	if err := stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Header_{Header: &pb.LoadExpertsRequest_Header{
		Name: "held", TotalBytes: 16*16 + 16*16 + 8,
		Weights: &pb.ExpertWeights{Activation: pb.Activation_ACTIVATION_RELU2,
			W13:      &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{1, 16, 16}},
			W2:       &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{1, 16, 16}},
			W13Scale: f32, W2Scale: f32},
	}}}); err != nil {
		t.Fatal(err)
	}
	// The header may still be in flight when Send returns: signal only once
	// the daemon counts the upload as running, or the drain finds nothing to
	// wait for and the daemon exits before the probes below.
	deadline := time.Now().Add(defaultTimeout)
	for {
		_, metrics := httpGet(t, admin+"/metrics")
		if metricValue(metrics, "expertd_calls_running") == "1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics: expertd_calls_running = %q, want 1 while the upload is open", metricValue(metrics, "expertd_calls_running"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	deadline = time.Now().Add(defaultTimeout)
	for {
		code, body := httpGet(t, admin+"/readyz")
		if code == http.StatusServiceUnavailable && strings.Contains(body, "draining") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz while draining: %d %q, want 503 draining", code, body)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if code, _ := httpGet(t, admin+"/livez"); code != http.StatusOK {
		t.Errorf("/livez while draining: %d, want 200 (a drain is not a reason to restart)", code)
	}
	streamCancel()
	d.stop(t)
}
