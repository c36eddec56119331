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
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/moe"
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
	opts   Options
	// gemm is the EXPERTD_GEMM_* path every call asks for (opts.GEMM).
	gemm int64

	mu     sync.Mutex
	closed bool
	live   map[*loaded]struct{}  // sets to free on Close
	lanes  map[*gpuLane]struct{} // lanes to close on Close, before the sets
}

// New opens the library named by cfg.LibraryPath (or found by the default
// search, see findLibrary) on GPU cfg.Device and self-tests it.
func New(cfg kernels.Config) (*Backend, error) {
	opts := DefaultOptions()
	switch o := cfg.Options.(type) {
	case nil:
	case Options:
		opts = o
	default:
		return nil, fmt.Errorf("cuda: options of type %T, want cuda.Options", cfg.Options)
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	lib, err := openLibrary(cfg.LibraryPath)
	if err != nil {
		return nil, err
	}
	b := &Backend{lib: lib, device: cfg.Device, opts: opts, gemm: gemmPaths[opts.GEMM], live: map[*loaded]struct{}{}}
	buf := make([]byte, 256)
	err = b.call("init", func() int32 {
		if rc := lib.init(int32(cfg.Device), opts.c()); rc != codeOK {
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
		Activations:   []moe.Activation{moe.SiluGated, moe.Relu2, moe.SwigluOAI, moe.GeluTanhGated, moe.GeluGated},
		Granularities: []scaling.Granularity{scaling.PerTensor, scaling.PerExpert, scaling.PerChannel, scaling.Block},
		Devices:       []string{b.info},
		Details:       b.opts.Map(),
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
	lanes := make([]*gpuLane, 0, len(b.lanes))
	for l := range b.lanes {
		lanes = append(lanes, l)
	}
	b.mu.Unlock()
	var errs []error
	for _, l := range lanes {
		errs = append(errs, l.Close())
	}
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
	meta   *moe.ExpertSet // weights dropped: they live on the GPU
	mu     sync.RWMutex
	handle uint64
}

func (l *loaded) Set() *moe.ExpertSet { return l.meta }

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
// call, a cost of the same order as a decode-sized kernel; the
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
func (b *Backend) Load(ctx context.Context, set *moe.ExpertSet) (kernels.Loaded, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var act int32
	switch set.Activation {
	case moe.SiluGated:
		act = actSiluGated
	case moe.Relu2:
		act = actRelu2
	case moe.SwigluOAI:
		act = actSwigluOAI
	case moe.GeluTanhGated:
		act = actGeluTanhGated
	case moe.GeluGated:
		act = actGeluGated
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
	w13, b13 := set.W13, set.W13Bias
	switch {
	case set.Activation == moe.SwigluOAI && block != [2]int{}:
		// One row per scale block, so the scales move with their rows.
		s13 = expandBlocks(set.W13Scale, set.E, set.Rows1(), set.K, 1, block[1])
		s2 = expandBlocks(set.W2Scale, set.E, set.K, set.N, 1, block[1])
		block[0] = 1
	case block != [2]int{}:
		s13, s2, block[0] = blockScales(set)
	}
	if set.Activation == moe.SwigluOAI {
		w13 = gateFirst(set, w13, set.K)
		// Per-channel scales, or blocks of one row, move with their rows;
		// per-tensor and per-expert ones (1 or E values) have none.
		if rows := set.E * set.Rows1(); len(s13)%rows == 0 {
			s13 = gateFirst(set, s13, len(s13)/rows)
		}
		if b13 != nil {
			b13 = gateFirst(set, b13, 1)
		}
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
	params := &cSetParams{
		size: setParamsBytes, version: abiVersion,
		numExperts: int32(set.E), hidden: int32(set.K), inter: int32(set.N), activation: act,
		nW13Scale: int32(len(s13)), nW2Scale: int32(len(s2)), blockN: int32(block[0]), blockK: int32(block[1]),
		a13Scale: a13, a2Scale: a2,
		w13: goBuf(w13).data, w2: goBuf(set.W2).data, w13Scale: goBuf(s13).data, w2Scale: goBuf(s2).data,
		w13Bias: goBuf(b13).data, w2Bias: goBuf(set.W2Bias).data,
	}
	if set.Activation == moe.SwigluOAI {
		params.swigluLimit, params.swigluAlpha = set.SwigluLimit, set.SwigluAlpha
	}
	var h uint64
	err := b.call("set_create", func() int32 { return b.lib.setCreate(int32(b.device), params, &h) })
	// The params hold the slices' addresses as integers, which keep
	// nothing alive.
	runtime.KeepAlive(set)
	runtime.KeepAlive(w13)
	runtime.KeepAlive(s13)
	runtime.KeepAlive(s2)
	runtime.KeepAlive(b13)
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

// gateFirst reorders each expert's rows of v ([E, Rows1, width] elements)
// from the set's gate/up order (ExpertSet.GateUp: SwigluOAI's interleaved
// rows) to gate rows first, the order the kernels pair gate and up in.
func gateFirst[T any](set *moe.ExpertSet, v []T, width int) []T {
	out := make([]T, len(v))
	r1 := set.Rows1()
	for e := range set.E {
		src, dst := v[e*r1*width:(e+1)*r1*width], out[e*r1*width:(e+1)*r1*width]
		for j := range set.N {
			g, u := set.GateUp(j)
			copy(dst[j*width:(j+1)*width], src[g*width:(g+1)*width])
			copy(dst[(set.N+j)*width:(set.N+j+1)*width], src[u*width:(u+1)*width])
		}
	}
	return out
}

// blockScales returns the set's weight scales in the library's block layout,
// [E, ceil(rows/bn), ceil(cols/Bk)], and the bn they use. Block scales pass
// through. The others are constant over any block (per-tensor, per-expert)
// or over one row of any K block (per-channel), so they are expanded: with
// bn = 1 when either scale is per-channel, else the set's Bn. The set's
// activations are quantized per group of Bk whatever its weight scales, as
// kernels/cpu does, which is why block mode is kept for them at all.
func blockScales(set *moe.ExpertSet) (s13, s2 []float32, bn int) {
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
func (b *Backend) FusedMoE(ctx context.Context, set kernels.Loaded, req *moe.Request) (*moe.Result, error) {
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
func addr(t moe.Tensor) uintptr {
	if t.Dev != 0 {
		return t.Dev
	}
	if len(t.Data) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&t.Data[0]))
}

func setOf(l kernels.Loaded) *moe.ExpertSet { return l.Set() }

// dtypeCode is the ABI's code for a tensor element type the library takes
// in that place, or 0.
func dtypeCode(dt moe.DType, allowed ...moe.DType) int32 {
	for _, a := range allowed {
		if dt != a {
			continue
		}
		switch dt {
		case moe.Float32:
			return dtypeFloat32
		case moe.BFloat16:
			return dtypeBFloat16
		case moe.Float8E4M3FN:
			return dtypeFloat8
		}
	}
	return 0
}

// tensorBuf describes a request tensor to the library: device tensors say
// so; host bytes may be Go memory or a page-locked shared-memory mapping,
// which only the driver can tell apart.
func tensorBuf(t moe.Tensor, dtype int32) cBuf {
	if t.Dev != 0 {
		return cBuf{data: t.Dev, dtype: dtype, mem: memDevice}
	}
	return cBuf{data: addr(t), dtype: dtype, mem: memUnknown}
}

// goBuf describes a Go slice's bytes (pageable host memory), or an absent
// buffer for an empty slice.
func goBuf[T any](s []T) cBuf {
	if len(s) == 0 {
		return cBuf{}
	}
	return cBuf{data: uintptr(unsafe.Pointer(&s[0])), mem: memPageable}
}

// packCall checks req against the set and describes it, with out as the
// host output (unless req.OutDev is set), as the library's expertd_call.
// The routing results come back in the returned slices (nil, and not
// asked of the library, under req.NoRouting), the kernel time in *ms.
func packCall(meta *moe.ExpertSet, req *moe.Request, out []byte, gemm int64, graph bool, ms *float32) (*cCall, []int32, []float32, error) {
	m, topK := req.M(), req.Routing.TopK
	if topK < 1 || topK > maxTopK || topK > meta.E {
		return nil, nil, nil, fmt.Errorf("cuda: top_k %d with %d experts (max %d): %w", topK, meta.E, maxTopK, kernels.ErrUnsupported)
	}
	c := &cCall{size: callBytes, version: abiVersion, m: int32(m), topK: int32(topK), gemm: int32(gemm)}
	hd := dtypeCode(req.Hidden.DType, moe.Float32, moe.BFloat16, moe.Float8E4M3FN)
	if hd == 0 {
		return nil, nil, nil, fmt.Errorf("cuda: hidden dtype %v: %w", req.Hidden.DType, kernels.ErrUnsupported)
	}
	if hd == dtypeFloat8 {
		n, bk := len(req.HiddenScale), meta.Block[1]
		if n > 1 && n != m && (bk == 0 || n != m*((meta.K+bk-1)/bk)) {
			return nil, nil, nil, fmt.Errorf("cuda: %d hidden scales for M=%d, K=%d, block %v", n, m, meta.K, meta.Block)
		}
		c.nHiddenScale = int32(n)
		c.hiddenScale = goBuf(req.HiddenScale)
	}
	od := dtypeCode(req.OutDType, moe.Float32, moe.BFloat16)
	if od == 0 {
		return nil, nil, nil, fmt.Errorf("cuda: output dtype %v: %w", req.OutDType, kernels.ErrUnsupported)
	}
	r := req.Routing
	if r.Renormalize {
		c.renormalize = 1
	}
	c.scoring = scoringSoftmax
	if r.Scoring == moe.Sigmoid {
		c.scoring = scoringSigmoid
	}
	c.numGroups, c.topKGroups = int32(r.NumGroups), int32(r.TopKGroups)
	c.routedScalingFactor = r.ScalingFactor
	if graph {
		c.useGraph = 1
	}
	if req.TopKIDs != nil {
		if len(req.TopKIDs) != m*topK || len(req.TopKWeights) != m*topK {
			return nil, nil, nil, fmt.Errorf("cuda: topk ids/weights have %d/%d values, want %d", len(req.TopKIDs), len(req.TopKWeights), m*topK)
		}
		c.topKIDsIn, c.topKWeightsIn = goBuf(req.TopKIDs), goBuf(req.TopKWeights)
	} else {
		ld := dtypeCode(req.Logits.DType, moe.Float32, moe.BFloat16)
		if ld == 0 {
			return nil, nil, nil, fmt.Errorf("cuda: logits dtype %v: %w", req.Logits.DType, kernels.ErrUnsupported)
		}
		if req.Logits.Dev == 0 && len(req.Logits.Data) != m*meta.E*req.Logits.DType.Size() {
			return nil, nil, nil, fmt.Errorf("cuda: logits have %d bytes, want %d", len(req.Logits.Data), m*meta.E*req.Logits.DType.Size())
		}
		c.logits = tensorBuf(req.Logits, ld)
		c.correctionBias = goBuf(r.CorrectionBias)
	}
	if (req.Hidden.Dev == 0 && len(req.Hidden.Data) != m*meta.K*req.Hidden.DType.Size()) ||
		(req.OutDev == 0 && len(out) != m*meta.K*req.OutDType.Size()) {
		return nil, nil, nil, fmt.Errorf("cuda: hidden/output sizes %d/%d do not match M=%d K=%d", len(req.Hidden.Data), len(out), m, meta.K)
	}
	c.hidden = tensorBuf(req.Hidden, hd)
	if req.OutDev != 0 {
		c.out = cBuf{data: req.OutDev, dtype: od, mem: memDevice}
	} else {
		c.out = tensorBuf(moe.Tensor{Data: out}, od)
	}
	var ids []int32
	var w []float32
	if !req.NoRouting {
		ids, w = make([]int32, m*topK), make([]float32, m*topK)
		c.topKIDsOut, c.topKWeightsOut = goBuf(ids), goBuf(w)
	}
	c.kernelMS = uintptr(unsafe.Pointer(ms))
	return c, ids, w, nil
}

// run is FusedMoE with the output buffer, GEMM path and graph use chosen by
// the caller (tests poison out and compare paths).
func (b *Backend) run(ctx context.Context, set kernels.Loaded, req *moe.Request, out []byte, gemm int64, graph bool) (*moe.Result, error) {
	l, ok := set.(*loaded)
	if !ok || l.b != b {
		return nil, fmt.Errorf("cuda: expert set %T was not loaded by this backend", set)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// The call struct holds ms's address as an integer, which a moving
	// goroutine stack would leave stale: ms lives on the heap, pinned for
	// the call.
	ms := new(float32)
	var pin runtime.Pinner
	pin.Pin(ms)
	defer pin.Unpin()
	c, ids, w, err := packCall(l.meta, req, out, gemm, graph, ms)
	if err != nil {
		return nil, err
	}
	if req.OutDev != 0 {
		out = nil
	}

	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.handle == 0 {
		return nil, errors.New("cuda: expert set is closed")
	}
	h := l.handle
	err = b.call("moe", func() int32 { return b.lib.moe(h, c) })
	runtime.KeepAlive(req)
	runtime.KeepAlive(out)
	runtime.KeepAlive(ids)
	runtime.KeepAlive(w)
	if err != nil {
		return nil, err
	}
	return &moe.Result{Output: out, TopKIDs: ids, TopKWeights: w, KernelNanos: int64(float64(*ms) * 1e6)}, nil
}
