package weights

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync/atomic"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/semaphore"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// A BF16 or FP16 checkpoint (Mixtral, Qwen3-MoE, DeepSeek's BF16
// conversions) is quantized to FP8 E4M3 as it is read, expert by expert:
// a worker reads one expert's matrix in its own dtype, quantizes it into
// the set's FP8 buffer and reuses its staging for the next expert, so a
// load holds at most a few experts' matrices in 16 bits, never a layer.

// halfDtypes are the safetensors dtypes of weights quantized on load.
var halfDtypes = map[string]moe.DType{"BF16": moe.BFloat16, "F16": moe.Float16}

// defaultWeightQuantization is what WEIGHT_QUANTIZATION_UNSPECIFIED gives.
// Per-channel keeps the most accuracy of the three (TestWeightQuantization
// Accuracy measures them against float64): E4M3 rounds every element to 3
// mantissa bits whatever its scale, so what a granularity changes is how
// many elements are exact (each scale's amax maps to ±448) and how far an
// outlier pushes its neighbours towards the subnormals. One scale per row
// confines an outlier to its row, and a row of K <= 16384 columns is
// fewer elements than a [128, 128] tile; per-tensor lets one outlier
// coarsen the whole matrix.
const defaultWeightQuantization = PerChannel

// maxQuantStaging bounds the 16-bit and float32 staging of every load
// quantizing at once, daemon-wide; an expert larger than it loads alone.
const maxQuantStaging = 1 << 30

// quantStaging holds maxQuantStaging; a worker holds its staging's bytes.
var quantStaging = semaphore.NewWeighted(maxQuantStaging)

// HalfQuantizer is what a backend implements to quantize half-precision
// checkpoint weights itself (on its device, for instance) instead of on
// the host; the service hands it to a Loader when the backend has it,
// and the CPU path runs otherwise. QuantizeHalf quantizes one expert's
// row-major [rows, cols] matrix, src holding its little-endian BFloat16 or
// Float16 values (dt), into dst's rows·cols E4M3FN codes, and writes its
// scales to scales:
// amax/448 clamped to scaling.MinScale over each group of g (1 value for
// scaling.PerTensor, rows for PerChannel, ceil(rows/Bn)·ceil(cols/Bk) for
// Block), encoded as the scaling package encodes. The loader calls it from
// several goroutines at once, each with its own buffers.
type HalfQuantizer interface {
	QuantizeHalf(ctx context.Context, dst, src []byte, dt moe.DType, rows, cols int, g scaling.Granularity, block [2]int, scales []float32) error
}

// cpuQuantizer is the host path, with one worker's float32 staging.
type cpuQuantizer struct{ f []float32 }

func (q *cpuQuantizer) QuantizeHalf(_ context.Context, dst, src []byte, dt moe.DType, rows, cols int, g scaling.Granularity, block [2]int, scales []float32) error {
	v := q.f[:rows*cols]
	decodeHalf(v, src, dt)
	ws := scaling.QuantizeWeightsInto(dst, v, 1, rows, cols, g, block)
	copy(scales, ws.Values)
	return nil
}

// decodeHalf widens little-endian BF16 or FP16 values to float32.
func decodeHalf(dst []float32, src []byte, dt moe.DType) {
	dec := scaling.BF16ToFloat32
	if dt == moe.Float16 {
		dec = scaling.FP16ToFloat32
	}
	for i := range dst {
		dst[i] = dec(binary.LittleEndian.Uint16(src[2*i:]))
	}
}

// weightGranularity is the scaling granularity src asks for.
func weightGranularity(src *Source) (scaling.Granularity, error) {
	q := src.WeightQuantization
	if q == QuantizationUnspecified {
		q = defaultWeightQuantization
	}
	switch q {
	case PerTensor:
		return scaling.PerTensor, nil
	case PerChannel:
		return scaling.PerChannel, nil
	case Block:
		return scaling.Block, nil
	}
	return 0, invalidf("safetensors.weight_quantization", "%v: want PER_TENSOR, PER_CHANNEL, BLOCK or UNSPECIFIED", q)
}

// scalesPerExpert is how many scales g gives one expert's rows x cols
// matrix, and the set's scale shape for e experts.
func scalesPerExpert(g scaling.Granularity, e, rows, cols int, block [2]int) (int, []int) {
	switch g {
	case scaling.PerChannel:
		return rows, []int{e, rows}
	case scaling.Block:
		nb, kb := ceilDiv(rows, block[0]), ceilDiv(cols, block[1])
		return nb * kb, []int{e, nb, kb}
	}
	return 1, []int{e} // one per expert: the set's per-expert form
}

// halfMatrix is one of an expert's two matrices: its parts' tensor names
// (stacked row-wise), rows per part, and where it goes in the set.
type halfMatrix struct {
	names  func(e int) []projection
	rows   []int
	cols   int
	buf    int // moe.SetW13 or moe.SetW2
	scales []float32
	per    int
}

// assembleHalf is assemble for BF16 or F16 weights of dtype dt, whose
// shapes assemble has checked: gated w13 parts of rows[p] x k, w2 k x n.
// It quantizes each expert's matrices to FP8 at src's granularity with q
// (nil: on the host), in parallel over experts.
func assembleHalf(ctx context.Context, f *stFile, src *Source, lay func(e int) stLayout,
	numE int, rows []int, k, n int, dt string, block [2]int, b Budget, q HalfQuantizer, wrap func(error) error) (*Set, error) {
	g, err := weightGranularity(src)
	if err != nil {
		return nil, err
	}
	r := 0
	for _, x := range rows {
		r += x
	}
	mats := []*halfMatrix{
		{names: func(e int) []projection { return lay(e).w13 }, rows: rows, cols: k, buf: moe.SetW13},
		{names: func(e int) []projection { return []projection{lay(e).w2} }, rows: []int{k}, cols: n, buf: moe.SetW2},
	}
	per13, s13Shape := scalesPerExpert(g, numE, r, k, block)
	per2, s2Shape := scalesPerExpert(g, numE, k, n, block)
	mats[0].per, mats[1].per = per13, per2
	mats[0].scales, mats[1].scales = make([]float32, numE*per13), make([]float32, numE*per2)
	d := &moe.SetDecl{Activation: lay(0).act}
	d.Tensors[moe.SetW13] = fp8Decl(numE, r, k)
	d.Tensors[moe.SetW2] = fp8Decl(numE, k, n)
	d.Tensors[moe.SetW13Scale] = scaleDecl(nil, s13Shape...)
	d.Tensors[moe.SetW2Scale] = scaleDecl(nil, s2Shape...)
	if g == scaling.Block {
		d.BlockShape = block[:]
	}
	l, a, err := reserveLayer(f, src, lay, numE, r, k, d, b, wrap)
	if err != nil {
		return nil, err
	}

	// Each worker stages one matrix at a time: its 16-bit bytes, and
	// float32 values on the host path, at most 3 times the matrix's 16-bit
	// bytes. With at most a quarter of the experts staged at once (one
	// below four experts), the staging of a layer of four or more stays
	// under 3/4 of its 16-bit bytes however many cores there are, and the
	// load under 1.25 times them with the FP8 set it builds.
	elems := max(r*k, k*n)
	staging := int64(elems) * 2
	if q == nil {
		staging += int64(elems) * 4
	}
	workers := min(runtime.GOMAXPROCS(0), max(1, numE/4), max(1, int(maxQuantStaging/staging)))
	hl := &halfLoad{f: f, a: a, dt: dt, g: g, block: block, wrap: wrap}
	eg, ctx := errgroup.WithContext(ctx)
	var next atomic.Int64 // the next expert to quantize
	for range workers {
		eg.Go(func() error {
			hold := min(staging, maxQuantStaging)
			if err := quantStaging.Acquire(ctx, hold); err != nil {
				return err
			}
			defer quantStaging.Release(hold)
			half := make([]byte, elems*2)
			wq := q
			if wq == nil {
				wq = &cpuQuantizer{f: make([]float32, elems)}
			}
			for {
				e := int(next.Add(1) - 1)
				if e >= numE {
					return nil
				}
				// A load of many experts reads for a long time: its
				// deadline, its cancellation and the drain (which cancels
				// it) stop it between experts.
				if err := ctx.Err(); err != nil {
					return err
				}
				for _, m := range mats {
					if err := hl.quantize(ctx, m, e, half, wq); err != nil {
						if ctx.Err() != nil {
							return ctx.Err()
						}
						return err
					}
				}
			}
		})
	}
	if err := eg.Wait(); err != nil {
		a.Release()
		return nil, err
	}
	a.bufs[moe.SetW13Scale] = moe.Float32Bytes(mats[0].scales)
	a.bufs[moe.SetW2Scale] = moe.Float32Bytes(mats[1].scales)
	if a.Set, err = l.Build("safetensors", a.bufs); err != nil {
		a.Release()
		return nil, err
	}
	return a, nil
}

// halfLoad is what a load's workers share: the file, the set they fill,
// how to quantize, and wrap, which names the file in a request's errors.
type halfLoad struct {
	f     *stFile
	a     *Set
	dt    string
	g     scaling.Granularity
	block [2]int
	wrap  func(error) error
}

// quantize reads expert e's parts of m into half and quantizes them with q
// into the set's buffer and m's scales. A fault of q's is the server's
// (Internal), not the request's.
func (h *halfLoad) quantize(ctx context.Context, m *halfMatrix, e int, half []byte, q HalfQuantizer) error {
	r := 0
	for _, x := range m.rows {
		r += x
	}
	size := r * m.cols
	at := 0
	parts := m.names(e)
	for p, pr := range parts {
		n := m.rows[p] * m.cols * 2
		if err := h.f.readInto(pr.weight, h.dt, half[at:at+n]); err != nil {
			return h.wrap(err)
		}
		at += n
	}
	scales := m.scales[e*m.per : (e+1)*m.per]
	if err := q.QuantizeHalf(ctx, h.a.bufs[m.buf][e*size:(e+1)*size], half[:2*size], halfDtypes[h.dt], r, m.cols, h.g, h.block, scales); err != nil {
		return fmt.Errorf("quantizing %s: %w", quote(parts[0].weight), err)
	}
	// amax/448 is finite and > 0 exactly when the matrix is: NaN and Inf
	// weights would only be refused later as an unnamed bad scale.
	if i := slices.IndexFunc(scales, func(s float32) bool { return !(s > 0) || math.IsInf(float64(s), 0) }); i >= 0 {
		names := make([]string, len(parts))
		for p, pr := range parts {
			names[p] = pr.weight
		}
		return h.wrap(fmt.Errorf("a weight of %s is NaN or infinite, which no FP8 scale covers", quoteAll(names)))
	}
	return nil
}
