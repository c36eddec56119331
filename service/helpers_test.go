package service_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

// defaultTestTimeout bounds every RPC in these tests. It guards against
// a hang, so it sits far above what the slowest case (the numerics
// checks, with their float64 references) takes on a loaded 2-core machine
// under the race detector.
const defaultTestTimeout = time.Minute

func testContext(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	t.Cleanup(cancel)
	return ctx
}

// newRand is a fresh random source per test, seeded from the clock and
// logged so a failure can be replayed.
func newRand(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d", seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func bytesF32(b []byte) []float32 {
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

func i32Bytes(v []int32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return b
}

func f32Tensor(v []float32, shape ...int64) *pb.Tensor {
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: shape, Source: &pb.Tensor_Data{Data: f32Bytes(v)}}
}

func randn(rng *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64() * scale)
	}
	return v
}

// quantizeExperts quantizes randn weights [e, rows*cols] to FP8 with one
// scale per expert (amax/448), as checkpoints do.
func quantizeExperts(rng *rand.Rand, e, rows, cols int) ([]byte, []float32) {
	q := make([]byte, e*rows*cols)
	scales := make([]float32, e)
	for x := range e {
		w := randn(rng, rows*cols, 1)
		amax := float32(0)
		for _, v := range w {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		scales[x] = amax / scaling.E4M3Max
		for i, v := range w {
			q[x*rows*cols+i] = scaling.Float32ToE4M3(v / scales[x])
		}
	}
	return q, scales
}

// randomWeights is a fresh random expert set with per-expert weight scales
// and no static activation scales.
func randomWeights(rng *rand.Rand, act pb.Activation, e, k, n int) *pb.ExpertWeights {
	rows := n
	if act != pb.Activation_ACTIVATION_RELU2 {
		rows = 2 * n
	}
	w13, s13 := quantizeExperts(rng, e, rows, k)
	w2, s2 := quantizeExperts(rng, e, k, n)
	fp8 := func(b []byte, shape ...int64) *pb.Tensor {
		return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: shape, Source: &pb.Tensor_Data{Data: b}}
	}
	return &pb.ExpertWeights{
		Activation: act,
		W13:        fp8(w13, int64(e), int64(rows), int64(k)),
		W2:         fp8(w2, int64(e), int64(k), int64(n)),
		W13Scale:   f32Tensor(s13, int64(e)),
		W2Scale:    f32Tensor(s2, int64(e)),
	}
}

// fingerprintOf is the documented fingerprint: SHA-256 of the tensors'
// bytes in field order.
func fingerprintOf(w *pb.ExpertWeights) string {
	h := sha256.New()
	for _, t := range []*pb.Tensor{w.GetW13(), w.GetW2(), w.GetW13Scale(), w.GetW2Scale(), w.GetA13Scale(), w.GetA2Scale(),
		w.GetW13Bias(), w.GetW2Bias()} {
		h.Write(t.GetData())
	}
	return hex.EncodeToString(h.Sum(nil))
}

// fakeBackend records what the service hands it and returns a recognizable
// output, so tests can check conversion without running kernels.
type fakeBackend struct {
	mu      sync.Mutex
	calls   []*moe.Request
	loads   int
	closes  int
	release chan struct{} // when set, FusedMoE waits on it
	started chan struct{} // signalled as each FusedMoE call starts
	// delay, when set, is how long each call takes.
	delay func(*moe.Request) time.Duration
	// inFlight and maxInFlight count concurrent FusedMoE calls.
	inFlight, maxInFlight int
}

type fakeLoaded struct {
	b   *fakeBackend
	set *moe.ExpertSet
}

func (l *fakeLoaded) Set() *moe.ExpertSet { return l.set }
func (l *fakeLoaded) Close() error {
	l.b.mu.Lock()
	l.b.closes++
	l.b.mu.Unlock()
	return nil
}

func (b *fakeBackend) Name() string { return "fake" }
func (b *fakeBackend) Capabilities() kernels.Capabilities {
	return kernels.Capabilities{
		Activations:   []moe.Activation{moe.SiluGated, moe.Relu2},
		Granularities: []scaling.Granularity{scaling.PerTensor, scaling.PerExpert},
		Devices:       []string{"fake device"},
		Details:       map[string]string{"streams": "2"},
	}
}
func (b *fakeBackend) Load(_ context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	b.mu.Lock()
	b.loads++
	b.mu.Unlock()
	return &fakeLoaded{b: b, set: set}, nil
}
func (b *fakeBackend) Close() error { return nil }

// FusedMoE fills the output (req.Out when set, as real backends do) with
// its element index (as FP32 or BF16) so the test can check shape and
// dtype end to end. Under NoRouting it returns no routing, as the CUDA
// backend does.
func (b *fakeBackend) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	b.mu.Lock()
	b.calls = append(b.calls, req)
	started, release := b.started, b.release
	b.inFlight++
	b.maxInFlight = max(b.maxInFlight, b.inFlight)
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.inFlight--
		b.mu.Unlock()
	}()
	if b.delay != nil {
		time.Sleep(b.delay(req))
	}
	if started != nil {
		started <- struct{}{}
	}
	if release != nil {
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	m, k := req.M(), l.Set().K
	out := req.Out
	if out == nil {
		out = make([]byte, m*k*req.OutDType.Size())
	}
	for i := range m * k {
		if req.OutDType == moe.Float32 {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(float32(i)))
		} else {
			binary.LittleEndian.PutUint16(out[2*i:], scaling.Float32ToBF16(float32(i)))
		}
	}
	if req.NoRouting {
		return &moe.Result{Output: out, KernelNanos: 1234}, nil
	}
	ids := slices.Clone(req.TopKIDs)
	ws := slices.Clone(req.TopKWeights)
	if ids == nil {
		ids = make([]int32, m*req.Routing.TopK)
		ws = make([]float32, m*req.Routing.TopK)
	}
	return &moe.Result{Output: out, TopKIDs: ids, TopKWeights: ws, KernelNanos: 1234}, nil
}

func (b *fakeBackend) numCalls() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.calls)
}

func (b *fakeBackend) lastCall() *moe.Request {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.calls) == 0 {
		return nil
	}
	return b.calls[len(b.calls)-1]
}

func (b *fakeBackend) counts() (loads, closes int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.loads, b.closes
}
