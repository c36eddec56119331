// Package cuda is expertd's GPU backend: native CUDA kernels in
// csrc/ (built into libexpertd_cuda.so by scripts/cuda-build.sh) behind a
// flat C ABI (csrc/expertd_cuda.h), loaded at run time with purego, so this
// package builds with CGO_ENABLED=0 and on machines with no GPU.
//
// Opening the backend loads the library, checks its ABI version, claims the
// configured GPU and runs a small self-test against the CPU backend; any
// failure is an error (never a panic), so backend=auto can fall back.
package cuda

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/scaling"
)

func init() {
	kernels.Register("cuda", func(cfg kernels.Config) (kernels.Backend, error) {
		b, err := New(cfg)
		if err != nil {
			return nil, err
		}
		return b, nil
	})
}

// Backend runs fused MoE on one GPU through libexpertd_cuda.so.
type Backend struct {
	lib    *library
	device int
	info   string
	// gemm is the EXPERTD_GEMM_* path every call asks for ($EXPERTD_CUDA_GEMM).
	gemm int64

	mu     sync.Mutex
	closed bool
	live   map[*loaded]struct{} // sets to free on Close
}

// gemmPaths maps $EXPERTD_CUDA_GEMM values to the ABI's path choice.
var gemmPaths = map[string]int64{
	"": gemmAuto, "auto": gemmAuto, "portable": gemmPortable, "portable-f16": gemmPortableF16, "sm90": gemmSM90,
}

// DefaultStreams is how many calls on one expert set run at once unless
// $EXPERTD_CUDA_STREAMS says otherwise: two let one call's host copies
// overlap the other's kernels.
const DefaultStreams = 2

// streams parses $EXPERTD_CUDA_STREAMS.
func streams() (int, error) {
	v := os.Getenv("EXPERTD_CUDA_STREAMS")
	if v == "" {
		return DefaultStreams, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > maxStreams {
		return 0, fmt.Errorf("cuda: EXPERTD_CUDA_STREAMS=%q: want 1..%d", v, maxStreams)
	}
	return n, nil
}

// New opens the library named by cfg.LibraryPath (or found by the default
// search, see findLibrary) on GPU cfg.Device and self-tests it.
func New(cfg kernels.Config) (*Backend, error) {
	gemm, ok := gemmPaths[os.Getenv("EXPERTD_CUDA_GEMM")]
	if !ok {
		return nil, fmt.Errorf("cuda: EXPERTD_CUDA_GEMM=%q: want auto, portable, portable-f16 or sm90", os.Getenv("EXPERTD_CUDA_GEMM"))
	}
	nstreams, err := streams()
	if err != nil {
		return nil, err
	}
	lib, err := openLibrary(cfg.LibraryPath)
	if err != nil {
		return nil, err
	}
	b := &Backend{lib: lib, device: cfg.Device, gemm: gemm, live: map[*loaded]struct{}{}}
	buf := make([]byte, 256)
	err = b.call("init", func() int32 {
		if rc := lib.init(int32(cfg.Device), int32(nstreams)); rc != codeOK {
			return rc
		}
		return lib.deviceInfo(int32(cfg.Device), &buf[0], int32(len(buf)))
	})
	if err != nil {
		return nil, err
	}
	b.info = strings.TrimRight(string(buf[:clen(buf)]), "\x00")
	if err := b.selfTest(); err != nil {
		return nil, fmt.Errorf("cuda: self-test on %s failed: %w", b.info, err)
	}
	return b, nil
}

func clen(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return len(b)
}

// codeError turns a library return code and its last-error string into a
// Go error, wrapping the kernels sentinels the service maps to statuses.
func codeError(op string, rc int32, msg string) error {
	err := fmt.Errorf("cuda: %s: %s: %s", op, codeName(rc), msg)
	switch rc {
	case codeUnsupported:
		return fmt.Errorf("%w: %w", err, kernels.ErrUnsupported)
	case codeOOM:
		return fmt.Errorf("%w: %w", err, kernels.ErrOutOfMemory)
	}
	return err
}

// Name implements kernels.Backend.
func (b *Backend) Name() string { return "cuda" }

// Capabilities implements kernels.Backend.
func (b *Backend) Capabilities() kernels.Capabilities {
	return kernels.Capabilities{
		Activations:   []kernels.Activation{kernels.SiluGated, kernels.Relu2},
		Granularities: []scaling.Granularity{scaling.PerTensor, scaling.PerExpert, scaling.PerChannel, scaling.Block},
		Devices:       []string{b.info},
	}
}

// Close implements kernels.Backend: it frees the sets still loaded (waiting
// for their calls in flight); calls after it fail.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	live := make([]*loaded, 0, len(b.live))
	for l := range b.live {
		live = append(live, l)
	}
	b.mu.Unlock()
	var errs []error
	for _, l := range live {
		errs = append(errs, l.Close())
	}
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	return errors.Join(errs...)
}

var errClosed = errors.New("cuda: backend is closed")

// loaded is an expert set resident in GPU memory.
type loaded struct {
	b      *Backend
	meta   *kernels.ExpertSet // weights dropped: they live on the GPU
	mu     sync.RWMutex
	handle uint64
}

func (l *loaded) Set() *kernels.ExpertSet { return l.meta }

// Close implements kernels.Loaded; calls in flight finish first.
func (l *loaded) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.handle == 0 {
		return nil
	}
	h := l.handle
	l.handle = 0
	l.b.mu.Lock()
	delete(l.b.live, l)
	l.b.mu.Unlock()
	return l.b.call("set_free", func() int32 { return l.b.lib.setFree(h) })
}

// call runs f, a library call, on the calling goroutine's thread, locked
// to it for the call so that the library's error string, which is per
// thread, is read on the thread that set it. Calling in place, rather than
// handing calls to a pool of locked threads, saves two thread wake-ups per
// call (tens of microseconds, against a 0.06 ms decode kernel); the
// library makes each call current on its set's device itself, and bounds
// the calls running on one set (expertd_init's streams).
func (b *Backend) call(op string, f func() int32) error {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return errClosed
	}
	runtime.LockOSThread()
	rc := f()
	var msg string
	if rc != codeOK {
		msg = b.lib.lastError()
	}
	runtime.UnlockOSThread()
	if rc != codeOK {
		return codeError(op, rc, msg)
	}
	return nil
}

// Load implements kernels.Backend: it uploads the weights and keeps only
// the set's metadata on the host.
func (b *Backend) Load(ctx context.Context, set *kernels.ExpertSet) (kernels.Loaded, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var act int32
	switch set.Activation {
	case kernels.SiluGated:
		act = actSiluGated
	case kernels.Relu2:
		act = actRelu2
	default:
		return nil, fmt.Errorf("cuda: activation %v: %w", set.Activation, kernels.ErrUnsupported)
	}
	for _, ws := range []scaling.WeightScale{set.W13Scale, set.W2Scale} {
		switch ws.Granularity {
		case scaling.PerTensor, scaling.PerExpert, scaling.PerChannel, scaling.Block:
		default:
			return nil, fmt.Errorf("cuda: %v weight scales: %w", ws.Granularity, kernels.ErrUnsupported)
		}
		if len(ws.Values) == 0 {
			return nil, fmt.Errorf("cuda: empty weight scale")
		}
	}
	if set.E > maxExperts {
		return nil, fmt.Errorf("cuda: %d experts (max %d): %w", set.E, maxExperts, kernels.ErrUnsupported)
	}
	if len(set.W13) != set.E*set.Rows1()*set.K || len(set.W2) != set.E*set.K*set.N {
		return nil, fmt.Errorf("cuda: weight sizes %d/%d do not match E=%d K=%d N=%d", len(set.W13), len(set.W2), set.E, set.K, set.N)
	}
	s13, s2, block := set.W13Scale.Values, set.W2Scale.Values, set.Block
	if block != [2]int{} {
		s13, s2, block[0] = blockScales(set)
	}
	if len(s13) > math.MaxInt32 || len(s2) > math.MaxInt32 {
		return nil, fmt.Errorf("cuda: %d and %d weight scales: %w", len(s13), len(s2), kernels.ErrUnsupported)
	}
	a13, a2 := float32(-1), float32(-1)
	if set.A13Scale != nil {
		a13 = max(*set.A13Scale, 1e-10)
	}
	if set.A2Scale != nil {
		a2 = max(*set.A2Scale, 1e-10)
	}
	var h uint64
	err := b.call("set_create", func() int32 {
		return b.lib.setCreate(int32(b.device), int32(set.E), int32(set.K), int32(set.N), act,
			&set.W13[0], &set.W2[0], &s13[0], int32(len(s13)), &s2[0], int32(len(s2)),
			int32(block[0]), int32(block[1]), a13, a2, &h)
	})
	runtime.KeepAlive(set)
	runtime.KeepAlive(s13)
	runtime.KeepAlive(s2)
	if err != nil {
		return nil, err
	}
	meta := *set
	meta.W13, meta.W2 = nil, nil
	l := &loaded{b: b, meta: &meta, handle: h}
	b.mu.Lock()
	b.live[l] = struct{}{}
	b.mu.Unlock()
	return l, nil
}

// blockScales returns the set's weight scales in the library's block layout,
// [E, ceil(rows/bn), ceil(cols/Bk)], and the bn they use. Block scales pass
// through. The others are constant over any block (per-tensor, per-expert)
// or over one row of any K block (per-channel), so they are expanded: with
// bn = 1 when either scale is per-channel, else the set's Bn. The set's
// activations are quantized per group of Bk whatever its weight scales, as
// kernels/cpu does, which is why block mode is kept for them at all.
func blockScales(set *kernels.ExpertSet) (s13, s2 []float32, bn int) {
	bn, bk := set.Block[0], set.Block[1]
	g13, g2 := set.W13Scale.Granularity, set.W2Scale.Granularity
	if g13 == scaling.Block && g2 == scaling.Block {
		return set.W13Scale.Values, set.W2Scale.Values, bn
	}
	if g13 == scaling.PerChannel || g2 == scaling.PerChannel {
		bn = 1
	}
	return expandBlocks(set.W13Scale, set.E, set.Rows1(), set.K, bn, bk),
		expandBlocks(set.W2Scale, set.E, set.K, set.N, bn, bk), bn
}

// expandBlocks samples ws, the scale of [e, rows, cols] weights, at the
// first element of every [bn, bk] block; ws must be constant on each.
func expandBlocks(ws scaling.WeightScale, e, rows, cols, bn, bk int) []float32 {
	nr, nc := (rows+bn-1)/bn, (cols+bk-1)/bk
	out := make([]float32, 0, e*nr*nc)
	for ex := range e {
		for rb := range nr {
			for kb := range nc {
				out = append(out, ws.At(ex, rb*bn, kb*bk))
			}
		}
	}
	return out
}

// FusedMoE implements kernels.Backend. Hidden and Logits may be device
// tensors and the output may go to device memory (Request.OutDev).
func (b *Backend) FusedMoE(ctx context.Context, set kernels.Loaded, req *kernels.Request) (*kernels.Result, error) {
	out := req.Out
	if n := req.M() * setOf(set).K * req.OutDType.Size(); len(out) != n && req.OutDev == 0 {
		if out != nil {
			return nil, fmt.Errorf("cuda: Out has %d bytes, want %d", len(out), n)
		}
		out = make([]byte, n)
	}
	return b.run(ctx, set, req, out, b.gemm, true)
}

// addr is the address of a tensor's bytes: its device address, or that of
// its host bytes (0 when it has neither).
func addr(t kernels.Tensor) uintptr {
	if t.Dev != 0 {
		return t.Dev
	}
	if len(t.Data) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&t.Data[0]))
}

func setOf(l kernels.Loaded) *kernels.ExpertSet { return l.Set() }

// run is FusedMoE with the output buffer, GEMM path and graph use chosen by
// the caller (tests poison out and compare paths).
func (b *Backend) run(ctx context.Context, set kernels.Loaded, req *kernels.Request, out []byte, gemm int64, graph bool) (*kernels.Result, error) {
	l, ok := set.(*loaded)
	if !ok || l.b != b {
		return nil, fmt.Errorf("cuda: expert set %T was not loaded by this backend", set)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	meta := l.meta
	m, topK := req.M(), req.Routing.TopK
	if topK < 1 || topK > maxTopK || topK > meta.E {
		return nil, fmt.Errorf("cuda: top_k %d with %d experts (max %d): %w", topK, meta.E, maxTopK, kernels.ErrUnsupported)
	}
	ip := make([]int64, numIParams)
	ip[pM] = int64(m)
	switch req.Hidden.DType {
	case kernels.Float32:
		ip[pHiddenDType] = dtypeFloat32
	case kernels.BFloat16:
		ip[pHiddenDType] = dtypeBFloat16
	case kernels.Float8E4M3FN:
		ip[pHiddenDType] = dtypeFloat8
		n, bk := len(req.HiddenScale), meta.Block[1]
		if n > 1 && n != m && (bk == 0 || n != m*((meta.K+bk-1)/bk)) {
			return nil, fmt.Errorf("cuda: %d hidden scales for M=%d, K=%d, block %v", n, m, meta.K, meta.Block)
		}
		ip[pNHiddenScale] = int64(len(req.HiddenScale))
	default:
		return nil, fmt.Errorf("cuda: hidden dtype %v: %w", req.Hidden.DType, kernels.ErrUnsupported)
	}
	switch req.OutDType {
	case kernels.Float32:
		ip[pOutDType] = dtypeFloat32
	case kernels.BFloat16:
		ip[pOutDType] = dtypeBFloat16
	default:
		return nil, fmt.Errorf("cuda: output dtype %v: %w", req.OutDType, kernels.ErrUnsupported)
	}
	r := req.Routing
	ip[pTopK] = int64(topK)
	if r.Renormalize {
		ip[pRenormalize] = 1
	}
	ip[pScoring] = scoringSoftmax
	if r.Scoring == kernels.Sigmoid {
		ip[pScoring] = scoringSigmoid
	}
	ip[pNumGroups] = int64(r.NumGroups)
	ip[pTopKGroups] = int64(r.TopKGroups)
	ip[pGEMM] = gemm
	if graph {
		ip[pUseGraph] = 1
	}
	fp := []float32{r.ScalingFactor}

	var logits uintptr
	var bias *float32
	var idsIn *int32
	var wIn *float32
	if req.TopKIDs != nil {
		if len(req.TopKIDs) != m*topK || len(req.TopKWeights) != m*topK {
			return nil, fmt.Errorf("cuda: topk ids/weights have %d/%d values, want %d", len(req.TopKIDs), len(req.TopKWeights), m*topK)
		}
		idsIn, wIn = &req.TopKIDs[0], &req.TopKWeights[0]
	} else {
		switch req.Logits.DType {
		case kernels.Float32:
			ip[pLogitsDType] = dtypeFloat32
		case kernels.BFloat16:
			ip[pLogitsDType] = dtypeBFloat16
		default:
			return nil, fmt.Errorf("cuda: logits dtype %v: %w", req.Logits.DType, kernels.ErrUnsupported)
		}
		if req.Logits.Dev == 0 && len(req.Logits.Data) != m*meta.E*req.Logits.DType.Size() {
			return nil, fmt.Errorf("cuda: logits have %d bytes, want %d", len(req.Logits.Data), m*meta.E*req.Logits.DType.Size())
		}
		logits = addr(req.Logits)
		if r.CorrectionBias != nil {
			bias = &r.CorrectionBias[0]
		}
	}
	var hs *float32
	if len(req.HiddenScale) > 0 && req.Hidden.DType == kernels.Float8E4M3FN {
		hs = &req.HiddenScale[0]
	}
	if (req.Hidden.Dev == 0 && len(req.Hidden.Data) != m*meta.K*req.Hidden.DType.Size()) ||
		(req.OutDev == 0 && len(out) != m*meta.K*req.OutDType.Size()) {
		return nil, fmt.Errorf("cuda: hidden/output sizes %d/%d do not match M=%d K=%d", len(req.Hidden.Data), len(out), m, meta.K)
	}
	outAddr := req.OutDev
	if outAddr == 0 {
		outAddr = uintptr(unsafe.Pointer(&out[0]))
	} else {
		out = nil
	}
	ids := make([]int32, m*topK)
	w := make([]float32, m*topK)
	var ms float32

	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.handle == 0 {
		return nil, errors.New("cuda: expert set is closed")
	}
	h := l.handle
	err := b.call("moe", func() int32 {
		return b.lib.moe(h, &ip[0], int32(len(ip)), &fp[0], int32(len(fp)), addr(req.Hidden), hs,
			logits, bias, idsIn, wIn, outAddr, &ids[0], &w[0], &ms)
	})
	runtime.KeepAlive(req)
	runtime.KeepAlive(out)
	if err != nil {
		return nil, err
	}
	return &kernels.Result{Output: out, TopKIDs: ids, TopKWeights: w, KernelNanos: int64(float64(ms) * 1e6)}, nil
}
