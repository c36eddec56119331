package service_test

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"

	"github.com/expertd/expertd/codec"
	"github.com/expertd/expertd/internal/durstat"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/kernels/kerneltest"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

// BenchmarkServicePath times FusedMoE calls with the Nemotron payload (E
// = 128, K = 2688, top_k 6; M = 64 BF16 hidden states and FP32 logits in,
// BF16 out: 377 KB in, 344 KB out) over a real loopback TCP connection,
// one call at a time, with the daemon's server options. backend=null does
// no compute, so its ns/op is the service path alone; backend=cpu runs
// the CPU backend with N scaled to 64. codec=grpc swaps in grpc-go's own
// protobuf codec on both ends, for comparison. Besides ns/op it reports
// the medians of the server's kernel and total time and of what the RPC
// (client latency - server total) and the handler (total - kernel) add.
//
//	go test -run '^$' -bench ServicePath -benchtime 200x ./service
func BenchmarkServicePath(b *testing.B) {
	shape := kerneltest.Nemotron.Scaled(kerneltest.Nemotron.K, 64)
	const m = 64
	rng := rand.New(rand.NewPCG(1, 2))
	set, _ := kerneltest.NewCase(rng, shape, 1)
	var reqs [4]*pb.FusedMoERequest
	for i := range reqs {
		// Built here rather than by kerneltest.NewCase, which would
		// generate a layer of weights per request and swamp a profile.
		hidden := make([]byte, 2*m*shape.K)
		for j, x := range randn(rng, m*shape.K, 0.1) {
			binary.LittleEndian.PutUint16(hidden[2*j:], scaling.Float32ToBF16(x))
		}
		reqs[i] = &pb.FusedMoERequest{
			Experts:      &pb.FusedMoERequest_ExpertSet{ExpertSet: "layer"},
			HiddenStates: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{m, int64(shape.K)}, Source: &pb.Tensor_Data{Data: hidden}},
			RouterLogits: f32Tensor(randn(rng, m*shape.E, 1), m, int64(shape.E)),
			Routing: &pb.Routing{TopK: int32(shape.TopK), Renormalize: true, Scoring: pb.Scoring_SCORING_SIGMOID,
				CorrectionBias: f32Tensor(randn(rng, shape.E, 0.1), int64(shape.E)), RoutedScalingFactor: shape.ScalingFactor},
		}
	}
	for _, bc := range []struct {
		backend string
		codec   string
	}{{"null", "alias"}, {"null", "grpc"}, {"cpu", "alias"}, {"cpu", "grpc"}} {
		b.Run("backend="+bc.backend+"/codec="+bc.codec, func(b *testing.B) {
			var backend kernels.Backend = servicetest.NullBackend{Backend: &fakeBackend{}}
			if bc.backend == "cpu" {
				backend = cpu.New(kernels.Config{})
			}
			var cdc encoding.CodecV2 = codec.Codec{}
			if bc.codec == "grpc" {
				cdc = encoding.GetCodecV2("proto")
			}
			c := startTCP(b, backend, cdc)
			ctx := context.Background()
			w := weightsProto(set)
			if _, err := servicetest.Upload(ctx, c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 2<<20)); err != nil {
				b.Fatalf("LoadExperts: %v", err)
			}
			var kernel, total, rpc, handler []time.Duration
			b.ResetTimer()
			for i := range b.N {
				t0 := time.Now()
				resp, err := c.FusedMoE(ctx, reqs[i%len(reqs)])
				d := time.Since(t0)
				if err != nil {
					b.Fatal(err)
				}
				t := resp.GetTimings()
				kernel = append(kernel, time.Duration(t.GetKernelNanos()))
				total = append(total, time.Duration(t.GetTotalNanos()))
				rpc = append(rpc, d-time.Duration(t.GetTotalNanos()))
				handler = append(handler, time.Duration(t.GetTotalNanos()-t.GetKernelNanos()))
			}
			b.StopTimer()
			med := func(v []time.Duration) float64 { return durstat.Of(v, 0.5) }
			b.ReportMetric(med(kernel), "kernel-ns")
			b.ReportMetric(med(total), "server-ns")
			b.ReportMetric(med(rpc), "rpc-ns")
			b.ReportMetric(med(handler), "handler-ns")
		})
	}
}

// startTCP serves backend on a loopback port with the daemon's server
// options and codec c, and returns a client using c too.
func startTCP(b *testing.B, backend kernels.Backend, c encoding.CodecV2) pb.ExpertServiceClient {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := service.New(service.Config{MaxConcurrent: 4}, backend, nil)
	gs := grpc.NewServer(append(srv.ServerOptions(), grpc.ForceServerCodecV2(c),
		grpc.MaxRecvMsgSize(256<<20), grpc.MaxSendMsgSize(256<<20))...)
	srv.Register(gs)
	go gs.Serve(lis) //nolint:errcheck // returns when stopped
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(c), grpc.MaxCallRecvMsgSize(256<<20), grpc.MaxCallSendMsgSize(256<<20)))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		conn.Close()
		gs.Stop()
	})
	return pb.NewExpertServiceClient(conn)
}
