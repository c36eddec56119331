package main

import (
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service/servicetest"
)

// TestDaemon starts the real daemon on loopback ports and checks what an
// operator relies on: health, reflection, a FusedMoE call, metrics, the
// CPU fallback warning, call logs, and a clean drain on cancel.
func TestDaemon(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs servicetest.LogBuffer
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	// Debug: successful calls are logged at debug level.
	args := []string{"-listen", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0", "-log-format", "json", "-threads", "2", "-log-level", "debug"}
	go func() { done <- run(ctx, args, func(string) string { return "" }, &logs, ready) }()
	var addrs listening
	select {
	case addrs = <-ready:
	case err := <-done:
		t.Fatalf("run exited early: %v\n%s", err, logs.String())
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon not ready")
	}
	callCtx, callCancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer callCancel()

	conn, err := grpc.NewClient(addrs.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	for _, svc := range []string{"", "expertd.v1.ExpertService"} {
		resp, err := healthpb.NewHealthClient(conn).Check(callCtx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q: %v %v, want SERVING", svc, resp, err)
		}
	}

	if got := listServicesV1(t, callCtx, conn); !slices.Contains(got, "expertd.v1.ExpertService") || !slices.Contains(got, "grpc.health.v1.Health") {
		t.Errorf("reflection v1 lists %v, want expertd.v1.ExpertService and grpc.health.v1.Health", got)
	}
	if doc := describeV1(t, callCtx, conn, "expertd.v1.ExpertService"); !strings.Contains(doc, "LoadExperts uploads one MoE layer") {
		t.Errorf("reflection serves expert.proto without its comments")
	}
	if got := listServicesV1alpha(t, callCtx, conn); !slices.Contains(got, "expertd.v1.ExpertService") {
		t.Errorf("reflection v1alpha lists %v, want expertd.v1.ExpertService", got)
	}

	c := pb.NewExpertServiceClient(conn)
	info, err := c.GetServerInfo(callCtx, &pb.GetServerInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetBackends()[0].GetName() != "cpu" || info.GetLimits().GetMaxTokens() != 8192 || info.GetLimits().GetMaxMessageBytes() != messageBytesFor(8192) {
		t.Errorf("GetServerInfo = %v, want the cpu backend with default limits", info)
	}
	checkReportedSettings(t, info)

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	const e, k, n, m = 4, 32, 16, 3
	fp8 := pb.DataType_DATA_TYPE_FLOAT8_E4M3FN
	req := &pb.FusedMoERequest{
		Experts: &pb.FusedMoERequest_Weights{Weights: &pb.ExpertWeights{
			Activation: pb.Activation_ACTIVATION_RELU2,
			W13:        tensor(fp8, randFP8(rng, e*n*k), e, n, k),
			W2:         tensor(fp8, randFP8(rng, e*k*n), e, k, n),
			W13Scale:   tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(0.001)),
			W2Scale:    tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(0.002)),
		}},
		HiddenStates: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*k)...), m, k),
		RouterLogits: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*e)...), m, e),
		Routing:      &pb.Routing{TopK: 2, Renormalize: true},
	}
	resp, err := c.FusedMoE(callCtx, req)
	if err != nil {
		t.Fatalf("FusedMoE: %v", err)
	}
	if got := len(resp.GetOutput().GetData()); got != m*k*2 || resp.GetBackend() != "cpu" {
		t.Errorf("output %d bytes from %q, want %d BF16 bytes from cpu", got, resp.GetBackend(), m*k*2)
	}

	metrics := get(t, "http://"+addrs.admin+"/metrics")
	for _, want := range []string{"expertd_tokens_total", "expertd_kernel_duration_seconds_bucket", "expertd_loaded_expert_bytes", "rpc_server_", "go_goroutines"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if got := get(t, "http://"+addrs.admin+"/healthz"); got != "ok\n" {
		t.Errorf("/healthz = %q, want ok", got)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run after cancel: %v", err)
		}
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon did not drain")
	}
	out := logs.String()
	for _, want := range []string{"CUDA backend unavailable", `"grpc.method":"FusedMoE"`, "finished call", "expertd stopped"} {
		if !strings.Contains(out, want) {
			t.Errorf("logs lack %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, `"grpc.service":"grpc.health.v1.Health"`) {
		t.Errorf("health checks were logged:\n%s", out)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func listServicesV1(t *testing.T, ctx context.Context, conn *grpc.ClientConn) []string {
	// An open stream would hold up the daemon's graceful stop.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	return names
}

func listServicesV1alpha(t *testing.T, ctx context.Context, conn *grpc.ClientConn) []string {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := reflectionv1alpha.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionv1alpha.ServerReflectionRequest{MessageRequest: &reflectionv1alpha.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	return names
}

// TestDrainDeadline checks an idle open stream cannot hold the daemon past
// -shutdown-timeout: the drain cuts it and run returns.
func TestDrainDeadline(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs servicetest.LogBuffer
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	args := []string{"-listen", "127.0.0.1:0", "-admin-addr", "", "-shutdown-timeout", "200ms", "-backend", "cpu"}
	go func() { done <- run(ctx, args, func(string) string { return "" }, &logs, ready) }()
	addrs := <-ready
	conn, err := grpc.NewClient(addrs.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	streamCtx, streamCancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer streamCancel()
	// A stream that sends nothing stays open on the server.
	if _, err := pb.NewExpertServiceClient(conn).FusedMoEStream(streamCtx); err != nil {
		t.Fatal(err)
	}
	stream, err := pb.NewExpertServiceClient(conn).FusedMoEStream(streamCtx)
	if err != nil {
		t.Fatal(err)
	}
	// A request that fails proves this stream is established server-side,
	// and so the idle one, whose headers went before on the connection.
	stream.Send(&pb.FusedMoERequest{}) //nolint:errcheck // the Recv below reports
	if _, err := stream.Recv(); err == nil {
		t.Fatal("empty request succeeded")
	}
	// A load balancer's health watch must see NOT_SERVING once the drain
	// begins.
	watch, err := healthpb.NewHealthClient(conn).Watch(streamCtx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := watch.Recv(); err != nil || st.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health watch before drain: %v %v, want SERVING", st, err)
	}

	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run: %v", err)
		}
		t.Logf("drained in %v", time.Since(start))
	case <-time.After(defaultTestTimeout):
		t.Fatal("an open stream held the daemon past the drain deadline")
	}
	if st, err := watch.Recv(); err != nil || st.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health watch during drain: %v %v, want NOT_SERVING", st, err)
	}
	if d := time.Since(start); d < 150*time.Millisecond || d > 5*time.Second {
		t.Errorf("drain took %v, want about the 200ms deadline", d)
	}
	if out := logs.String(); !strings.Contains(out, "streams still open at the drain deadline") || !strings.Contains(out, "expertd stopped") {
		t.Errorf("logs lack the forced-stop warning:\n%s", logs.String())
	}
}

// describeV1 fetches the file defining symbol by reflection v1, as grpcurl
// describe does, and returns its comments.
func describeV1(t *testing.T, ctx context.Context, conn *grpc.ClientConn, symbol string) string {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: symbol}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, raw := range resp.GetFileDescriptorResponse().GetFileDescriptorProto() {
		var fd descriptorpb.FileDescriptorProto
		if err := proto.Unmarshal(raw, &fd); err != nil {
			t.Fatal(err)
		}
		for _, loc := range fd.GetSourceCodeInfo().GetLocation() {
			b.WriteString(loc.GetLeadingComments())
		}
	}
	return b.String()
}
