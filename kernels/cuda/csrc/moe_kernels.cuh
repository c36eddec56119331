// Small kernels around the two grouped GEMMs: routing, token alignment,
// quantize-and-gather of the GEMM1 input, dynamic requantization of the
// intermediate, and the router-weighted combine. Semantics follow
// kernels/cpu (routing.go, moe.go), which follows MOE_SPEC.md section 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>

#include "launch.cuh"
#include "moe_gemm.h"
#include "route.cuh"

namespace expertd {

constexpr float kFP8Max = 448.0f;

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(b, __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// route_kernel: one warp per token (route_token). Per-warp shared memory:
// score, sel and group floats [E] each, then taken and keep bytes [E] each.
__global__ void route_kernel(RouteParams p, const void* logits, const float* bias, int32_t* ids,
                             float* weights) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t route_smem[];
  const int warps = blockDim.x / 32;
  const int wid = threadIdx.x / 32;
  const int tok = blockIdx.x * warps + wid;
  if (tok >= p.m) return;
  route_token(p, logits, bias, tok, route_smem + size_t(wid) * route_smem_per_warp(p.e), ids, weights);
}

// block_scan_exclusive returns the sum of v over the block's threads
// before this one and sets *total to the sum over all of them. red is 32
// ints of shared memory; blockDim.x is a multiple of 32; every thread of
// the block calls it.
__device__ __forceinline__ int block_scan_exclusive(int v, int* red, int* total) {
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  __syncthreads();  // red's previous readers are done
  if (lane == 31) red[wid] = x;
  __syncthreads();
  if (wid == 0) {
    int w = lane < nw ? red[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += y;
    }
    red[lane] = w;
  }
  __syncthreads();
  *total = red[nw - 1];
  return (wid > 0 ? red[wid - 1] : 0) + x - v;
}

// lay_out_runs turns per-expert pair counts (count[E], shared) into the
// experts' runs: count[e] becomes expert e's first block, cursor[e] (shared
// or global) its first row; returns the blocks in all. A block-wide scan,
// not one thread's walk over the experts: the walk's dependent
// shared-memory reads cost microseconds at E = 128 on every call.
template <typename Cursor>
__device__ __forceinline__ int lay_out_runs(int* count, Cursor* cursor, int E, int block_rows, int* red) {
  int carry = 0;
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int nb = e < E ? (count[e] + block_rows - 1) / block_rows : 0;
    int total;
    const int first = carry + block_scan_exclusive(nb, red, &total);
    if (e < E) {
      cursor[e] = first * block_rows;
      count[e] = first;
    }
    carry += total;
  }
  __syncthreads();
  return carry;
}

// fill_block_expert writes block_expert from the experts' first blocks
// (first[E], as lay_out_runs leaves count): expert e owns blocks
// [first[e], first[e+1]), and blocks from nb to max_blocks are -1.
__device__ __forceinline__ void fill_block_expert(const int* first, int E, int nb, int max_blocks,
                                                  int32_t* block_expert) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int end = e + 1 < E ? first[e + 1] : nb;
    for (int b = first[e]; b < end; ++b) block_expert[b] = e;
  }
  for (int b = nb + threadIdx.x; b < max_blocks; b += blockDim.x) block_expert[b] = -1;
}

// align_block is align_kernel's body, for a block of any size: smem is
// 2E ints and red 32 ints of shared memory. It returns the blocks in all.
// ids may have been written by this block (decode_prologue_kernel) before
// a __syncthreads, so they are read with plain loads.
__device__ __forceinline__ int align_block(const int32_t* ids, int n_pairs, int E, int block_rows, int max_blocks,
                                           int32_t* sorted_pairs, int32_t* block_expert, int32_t* num_blocks,
                                           int* smem, int* red) {
  int* count = smem;
  int* cursor = smem + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const int nb = lay_out_runs(count, cursor, E, block_rows, red);
  if (threadIdx.x == 0) *num_blocks = nb;
  fill_block_expert(count, E, nb, max_blocks, block_expert);
  for (int r = threadIdx.x; r < nb * block_rows; r += blockDim.x) sorted_pairs[r] = -1;
  __syncthreads();
  for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) sorted_pairs[atomicAdd(&cursor[e], 1)] = i;
  }
  return nb;
}

// align_kernel (one block) groups the n_pairs routed pairs by expert, each
// expert's run padded to a multiple of block_rows: sorted_pairs[row] = pair
// or -1, block_expert[block] = expert or -1, *num_blocks. Shared memory: two
// int arrays [E]. Pairs whose id is out of range are dropped (combine skips
// them). A row's place within its expert's run does not change its result
// (each sorted row is computed alone), so the order atomics give is fine.
// Large calls use align_count_kernel and align_scatter_kernel instead: one
// block's shared-memory atomics, two per pair, bound this kernel there.
__global__ void align_kernel(const int32_t* ids, int n_pairs, int E, int block_rows, int max_blocks,
                             int32_t* sorted_pairs, int32_t* block_expert, int32_t* num_blocks) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ int align_smem[];
  __shared__ int red[32];
  align_block(ids, n_pairs, E, block_rows, max_blocks, sorted_pairs, block_expert, num_blocks, align_smem, red);
}

// AlignScratch is the multi-block align's global state: per-expert counts
// and cursors, and the count kernel's ticket. The workspace starts zeroed,
// and the count kernel's last block zeroes counts and ticket again once it
// has read them, so every call (and graph replay) finds them zero, as long
// as every call finds them at the same place (Layout puts them first).
struct AlignScratch {
  int* count;   // [E]
  int* cursor;  // [E]: next free sorted row of each expert
  unsigned* ticket;
};

// count_chunk counts this block's chunk of pairs, [lo, hi), per expert
// into cnt (shared, E ints), which every thread may read on return.
__device__ __forceinline__ void count_chunk(const int32_t* ids, int n_pairs, int E, int* cnt, int& lo, int& hi) {
  const int chunk = (n_pairs + gridDim.x - 1) / gridDim.x;
  lo = min(n_pairs, int(blockIdx.x) * chunk);
  hi = min(n_pairs, lo + chunk);
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
}

// align_count_kernel: align_kernel's first half over many blocks. Each
// block counts its chunk of pairs per expert in shared memory and adds the
// counts to the global ones; the last block to finish lays the experts'
// runs out (cursor, block_expert, *num_blocks) and writes -1 into each
// expert's last block. Shared memory: int [E].
__global__ void align_count_kernel(const int32_t* ids, int n_pairs, int E, int block_rows, int max_blocks,
                                   AlignScratch a, int32_t* sorted_pairs, int32_t* block_expert,
                                   int32_t* num_blocks) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ int align_smem[];
  int* cnt = align_smem;
  __shared__ bool last;
  int lo, hi;
  count_chunk(ids, n_pairs, E, cnt, lo, hi);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (cnt[e]) atomicAdd(&a.count[e], cnt[e]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    cnt[e] = __ldcg(&a.count[e]);
    a.count[e] = 0;
  }
  __syncthreads();
  __shared__ int red[32];
  const int nb = lay_out_runs(cnt, a.cursor, E, block_rows, red);
  if (threadIdx.x == 0) {
    *num_blocks = nb;
    *a.ticket = 0;
  }
  fill_block_expert(cnt, E, nb, max_blocks, block_expert);
  // Padding: only an expert's last block has any. Mark all of it -1; the
  // scatter, which runs after this kernel, writes the pairs' rows over it.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int e = warp; e < E; e += warps) {
    const int first_row = cnt[e] * block_rows;
    const int end_row = (e + 1 < E ? cnt[e + 1] : nb) * block_rows;
    for (int r = max(first_row, end_row - block_rows) + lane; r < end_row; r += 32) sorted_pairs[r] = -1;
  }
}

// align_scatter_kernel: align_kernel's second half over many blocks (the
// same chunks as align_count_kernel). Each block counts its chunk per
// expert again, reserves that many rows of each expert's run with one
// global atomic, and places its pairs there. Shared memory: int [2E].
__global__ void align_scatter_kernel(const int32_t* ids, int n_pairs, int E, AlignScratch a,
                                     int32_t* sorted_pairs) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ int align_smem[];
  int* cnt = align_smem;
  int* base = align_smem + E;
  int lo, hi;
  count_chunk(ids, n_pairs, E, cnt, lo, hi);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    base[e] = cnt[e] ? atomicAdd(&a.cursor[e], cnt[e]) : 0;
    cnt[e] = 0;
  }
  __syncthreads();
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) sorted_pairs[base[e] + atomicAdd(&cnt[e], 1)] = i;
  }
}

__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  float r = lane < int(blockDim.x / 32) ? red[lane] : 0.f;
  return warp_max(r);
}

// GatherParams: how GEMM1's input rows are made.
struct GatherParams {
  int m, k, top_k;
  int group;  // scale group: block_k in block mode, else k
  int hidden_dtype;  // 1 FP32, 2 BF16, 4 FP8
  int n_hidden_scale;  // FP8: 0 (use fallback_scale), 1, M or M*ceil(k/group)
  float fallback_scale;  // FP8 with no scale: static a13 or 1
  float static_scale;  // BF16/FP32: > 0 static a13, else dynamic per token (group)
};

// quantize_groups quantizes one row of n values (element i is load(i)) to
// FP8 with dynamic scales amax/448 per group of `group` values (the last
// may be short), writing dst[0, n) and scales[0, ceil(n/group)). One group
// per row is a block-wide reduction; several are a warp each, which keeps
// every lane busy at DeepSeek-V3's 128-wide groups.
template <typename Load>
__device__ __forceinline__ void quantize_groups(Load load, int n, int group, uint8_t* dst, float* scales) {
  // Divide, not multiply by 1/s: the CPU backend and the reference do x / s,
  // and the two differ at FP8 rounding boundaries.
  const int ng = (n + group - 1) / group;
  if (ng == 1) {
    __shared__ float red[32];
    float amax = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) amax = fmaxf(amax, fabsf(load(i)));
    amax = block_max(amax, red);
    const float s = clamp_scale(amax / kFP8Max);
    if (threadIdx.x == 0) scales[0] = s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = to_e4m3(load(i) / s);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int gi = warp; gi < ng; gi += warps) {
    const int lo = gi * group, hi = min(lo + group, n);
    float amax = 0.f;
    for (int i = lo + lane; i < hi; i += 32) amax = fmaxf(amax, fabsf(load(i)));
    const float s = clamp_scale(warp_max(amax) / kFP8Max);
    if (lane == 0) scales[gi] = s;
    for (int i = lo + lane; i < hi; i += 32) dst[i] = to_e4m3(load(i) / s);
  }
}

// load8 reads elements [i, i+8) of a BF16 (dt 2) or FP32 row with 16-byte
// loads; the caller checks i % 8 == 0 and a 16-byte aligned row.
__device__ __forceinline__ void load8(const void* row, int i, int dt, float v[8]) {
  if (dt == 2) {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(row) + i);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(h[q]);
      v[2 * q] = f.x;
      v[2 * q + 1] = f.y;
    }
  } else {
    const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(row) + i);
    const float4 a = f[0], b = f[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
}

// store8 writes v / s as eight E4M3 bytes (dst 8-byte aligned).
__device__ __forceinline__ void store8(uint8_t* dst, const float v[8], float s) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    lo |= uint32_t(to_e4m3(v[q] / s)) << (8 * q);
    hi |= uint32_t(to_e4m3(v[4 + q] / s)) << (8 * q);
  }
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

// vec8_ok says whether a row of k elements of element size esize at src
// (and k FP8 bytes at dst) can move eight elements at a time.
__device__ __forceinline__ bool vec8_ok(const void* src, int esize, const void* dst, int k) {
  return k % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0 &&
         (reinterpret_cast<uintptr_t>(dst) & 7) == 0 && (esize * k) % 16 == 0;
}

// quantize_row writes the FP8 form of one BF16/FP32 row of K values (dt 2
// or 1) to dst: divided by the static scale s when s > 0, else with dynamic
// scales amax/448 per group of `group` values written to scales. Eight
// values a thread at a time where the row allows it; the arithmetic per
// value is the same either way (x / s, as kernels/cpu does), so both paths
// give the same bytes.
__device__ __forceinline__ void quantize_row(const void* src, int dt, int K, int group, float s, uint8_t* dst,
                                             float* scales) {
  if (s <= 0.f) {
    quantize_groups([&](int i) { return load_float(src, i, dt); }, K, group, dst, scales);
    return;
  }
  if (vec8_ok(src, dt == 2 ? 2 : 4, dst, K)) {
    for (int i = 8 * threadIdx.x; i < K; i += 8 * blockDim.x) {
      float v[8];
      load8(src, i, dt, v);
      store8(dst + i, v, s);
    }
    return;
  }
  for (int i = threadIdx.x; i < K; i += blockDim.x) dst[i] = to_e4m3(load_float(src, i, dt) / s);
}

// quant_tokens_kernel: one block per token; hq[tok] is the token's hidden
// row as FP8, hqs[tok, ceil(k/group)] its scales (dynamic scales only).
// Large calls quantize each token once here and let the gather copy FP8
// rows, instead of quantizing every token top_k times in the gather (see
// enqueue in moe_pipeline.cu).
__global__ void quant_tokens_kernel(int m, int k, int group, int hidden_dtype, float static_scale,
                                    const void* hidden, uint8_t* hq, float* hqs) {
  pdl_wait();
  pdl_trigger();
  const int tok = blockIdx.x;
  if (tok >= m) return;
  const int esize = hidden_dtype == 2 ? 2 : 4;
  const int ng = (k + group - 1) / group;
  quantize_row(static_cast<const uint8_t*>(hidden) + size_t(tok) * k * esize, hidden_dtype, k, group,
               static_scale, hq + size_t(tok) * k, hqs + size_t(tok) * ng);
}

// gather_quant_kernel: one block per sorted row of BF16/FP32 hidden
// states, quantized as they are gathered; writes a1q[row] (FP8) and,
// unless the scale is static, a1s[row, ceil(k/group)].
__global__ void gather_quant_kernel(GatherParams p, const void* hidden, const float* hidden_scale,
                                    const int32_t* sorted_pairs, const int32_t* num_blocks,
                                    int block_rows, uint8_t* a1q, float* a1s) {
  pdl_wait();
  pdl_trigger();
  const int row = blockIdx.x;
  if (row >= *num_blocks * block_rows) return;
  const int pair = sorted_pairs[row];
  if (pair < 0) return;
  const int tok = pair / p.top_k;
  const int K = p.k;
  const int ng = (K + p.group - 1) / p.group;
  uint8_t* dst = a1q + size_t(row) * K;
  const size_t src0 = size_t(tok) * K;
  const int esize = p.hidden_dtype == 2 ? 2 : 4;
  quantize_row(static_cast<const uint8_t*>(hidden) + src0 * esize, p.hidden_dtype, K, p.group, p.static_scale, dst,
               a1s + size_t(row) * ng);
}

// kGatherRowsPerBlock is gather_fp8_kernel's rows per block: a warp a row.
constexpr int kGatherRowsPerBlock = 8;

// token_scale is the clamped scale of scale group gi (of ng) of token tok's
// FP8 hidden row, as kernels/cpu reads hidden_scale: one value, one per
// token (checked first, so M = M*ng means per token), else one per token
// and group; none: fallback_scale.
__device__ __forceinline__ float token_scale(const GatherParams& p, const float* hidden_scale, int tok, int gi,
                                             int ng) {
  float s = p.fallback_scale;
  if (p.n_hidden_scale == 1) {
    s = hidden_scale[0];
  } else if (p.n_hidden_scale == p.m) {
    s = hidden_scale[tok];
  } else if (p.n_hidden_scale > 1) {
    s = hidden_scale[size_t(tok) * ng + gi];
  }
  return clamp_scale(s);
}

// gather_fp8_row copies sorted row `row` (pair >= 0) with one warp; see
// gather_fp8_kernel.
__device__ __forceinline__ void gather_fp8_row(const GatherParams& p, const uint8_t* hidden, const float* hidden_scale,
                                               int row, int pair, uint8_t* a1q, float* a1s) {
  const int lane = threadIdx.x % 32;
  const int tok = pair / p.top_k;
  const int K = p.k;
  const int ng = (K + p.group - 1) / p.group;
  uint8_t* dst = a1q + size_t(row) * K;
  const uint8_t* src = hidden + size_t(tok) * K;
  if (K % 16 == 0 && aligned16(src) && aligned16(dst)) {
    // Up to kUnroll loads a lane in flight before its stores: a row is
    // K/16 chunks (168 at K = 2688), and a copy loop would wait out one
    // round trip per chunk a lane holds.
    constexpr int kUnroll = 8;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    const int n = K / 16;
    for (int base = 0; base < n; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int i = base + 32 * j + lane;
        if (i < n) v[j] = s4[i];
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int i = base + 32 * j + lane;
        if (i < n) d4[i] = v[j];
      }
    }
  } else {
    for (int i = lane; i < K; i += 32) dst[i] = src[i];
  }
  for (int gi = lane; gi < ng; gi += 32) a1s[size_t(row) * ng + gi] = token_scale(p, hidden_scale, tok, gi, ng);
}

// gather_fp8_kernel: the gather when the hidden rows are FP8 already (the
// caller's, or quant_tokens_kernel's): a warp copies one sorted row, so a
// block moves eight rows instead of one (a block a row leaves the kernel
// bound by block scheduling at prefill sizes). a1s[row, ceil(k/group)]
// takes the row's token's scales (token_scale).
__global__ void gather_fp8_kernel(GatherParams p, const uint8_t* hidden, const float* hidden_scale,
                                  const int32_t* sorted_pairs, const int32_t* num_blocks, int block_rows,
                                  uint8_t* a1q, float* a1s) {
  pdl_wait();
  pdl_trigger();
  const int row = blockIdx.x * kGatherRowsPerBlock + threadIdx.x / 32;
  if (row >= *num_blocks * block_rows) return;
  const int pair = sorted_pairs[row];
  if (pair < 0) return;
  gather_fp8_row(p, hidden, hidden_scale, row, pair, a1q, a1s);
}

// kGatherScalesThreads is gather_scales_kernel's block size: a thread a row.
constexpr int kGatherScalesThreads = 256;

// gather_scales_kernel: gather_fp8_kernel's a1s alone, a thread a sorted
// row, for calls whose GEMM1 reads the FP8 hidden rows by token itself
// (sm90_gather_fold) and still takes the row scales by sorted row.
__global__ void gather_scales_kernel(GatherParams p, const float* hidden_scale, const int32_t* sorted_pairs,
                                     const int32_t* num_blocks, int block_rows, float* a1s) {
  pdl_wait();
  pdl_trigger();
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= *num_blocks * block_rows) return;
  const int pair = sorted_pairs[row];
  if (pair < 0) return;
  const int ng = (p.k + p.group - 1) / p.group;
  for (int gi = 0; gi < ng; ++gi) a1s[size_t(row) * ng + gi] = token_scale(p, hidden_scale, pair / p.top_k, gi, ng);
}

// decode_prologue_kernel (one block) runs a small call's steps before
// GEMM1 as one launch: routing (when route is set; route_warps warps, each
// with route_smem_per_warp(E) bytes of shared memory after the align
// step's 2E ints), the align step, and, when gather is set, the gather of
// FP8 hidden rows. At decode sizes each of those is a few dependent memory
// round trips, and a launch boundary between them costs as much again.
__global__ void __launch_bounds__(1024)
    decode_prologue_kernel(RouteParams rp, bool route, int route_warps, const void* logits, const float* bias,
                           int32_t* ids, float* weights, int n_pairs, int block_rows, int max_blocks,
                           int32_t* sorted_pairs, int32_t* block_expert, int32_t* num_blocks, bool gather,
                           GatherParams gp, const uint8_t* hidden, const float* hidden_scale, uint8_t* a1q,
                           float* a1s) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t prologue_smem[];
  __shared__ int red[32];
  const int E = rp.e;
  int* align_smem = reinterpret_cast<int*>(prologue_smem);
  uint8_t* route_smem = prologue_smem + ((size_t(2) * E * sizeof(int) + 15) & ~size_t(15));
  const int wid = threadIdx.x / 32, warps = blockDim.x / 32;
  if (route && wid < route_warps) {
    for (int tok = wid; tok < rp.m; tok += route_warps) {
      route_token(rp, logits, bias, tok, route_smem + size_t(wid) * route_smem_per_warp(E), ids, weights);
    }
  }
  __syncthreads();
  const int nb = align_block(ids, n_pairs, E, block_rows, max_blocks, sorted_pairs, block_expert, num_blocks,
                             align_smem, red);
  if (!gather) return;
  __syncthreads();
  for (int row = wid; row < nb * block_rows; row += warps) {
    const int pair = sorted_pairs[row];
    if (pair >= 0) gather_fp8_row(gp, hidden, hidden_scale, row, pair, a1q, a1s);
  }
}

// requant_kernel: dynamic FP8 quantization of GEMM1's FP32 output per
// sorted row and group of `group` columns (block_k in block mode, else n),
// one block per row; a2s is [row, ceil(n/group)].
__global__ void requant_kernel(const float* act, int n, int group, const int32_t* sorted_pairs,
                               const int32_t* num_blocks, int block_rows, uint8_t* a2q, float* a2s) {
  pdl_wait();
  pdl_trigger();
  const int row = blockIdx.x;
  if (row >= *num_blocks * block_rows) return;
  if (sorted_pairs[row] < 0) return;
  const float* src = act + size_t(row) * n;
  const int ng = (n + group - 1) / group;
  quantize_groups([&](int i) { return src[i]; }, n, group, a2q + size_t(row) * n, a2s + size_t(row) * ng);
}

// kCombineThreads is combine_kernel's block size; a block covers
// kCombineCols columns of one token (eight a thread).
constexpr int kCombineThreads = 128;
constexpr int kCombineCols = 8 * kCombineThreads;

// combine_kernel: out[t] = sum over slots j of the pair's GEMM2 row, in
// slot order, then, with a GEMM2 bias (bias2 [E, k], else null), the sum
// over slots of w[t*top_k + j] * bias2[id of j]: the bias a pair's GEMM2
// output gets before its router weight, added here where the weight is at
// hand. Pairs with an out-of-range id add 0.
// kSortedRows says where the rows are and whether they are weighted:
// false, y[t*top_k + j] with the router weight applied (the hand-written
// GEMM2's kWeightedBF16); true, y[pair_row[t*top_k + j]], unweighted in
// sorted order (the CUTLASS GEMM2, gemm_cutlass.h), times w[t*top_k + j]
// here.
// Grid: (m, ceil(k / kCombineCols)). A thread loads its columns of up to
// eight slots before it adds any (one round trip, not one a slot), and the
// grid spreads a token over several blocks, which small calls need to keep
// more than a handful of SMs busy.
template <bool kSortedRows>
__global__ void combine_kernel(const __nv_bfloat16* y, const int32_t* pair_row, const int32_t* ids, int m, int top_k,
                               int k, int E, int out_dtype, void* out, const float* w, const float* bias2) {
  pdl_wait();
  pdl_trigger();
  const int tok = blockIdx.x;
  if (tok >= m) return;
  __shared__ int valid[64];
  __shared__ int expert[64];
  __shared__ const __nv_bfloat16* yrow[64];
  __shared__ float ywt[64];
  if (threadIdx.x < top_k) {
    const size_t pair = size_t(tok) * top_k + threadIdx.x;
    const int e = ids[pair];
    const bool ok = e >= 0 && e < E;
    valid[threadIdx.x] = ok;
    expert[threadIdx.x] = e;
    // A dropped pair has no sorted row; its row is never read.
    yrow[threadIdx.x] = y + (kSortedRows ? (ok ? size_t(pair_row[pair]) : 0) : pair) * k;
    ywt[threadIdx.x] = kSortedRows ? w[pair] : 1.f;
  }
  __syncthreads();
  // bias_at is column c's GEMM2 bias term of the token.
  auto bias_at = [&](int c) {
    float b = 0.f;
    for (int j = 0; j < top_k; ++j) {
      if (valid[j]) b += w[size_t(tok) * top_k + j] * bias2[size_t(expert[j]) * k + c];
    }
    return b;
  };
  // add_row adds slot j's value f to acc: weighted here for sorted rows,
  // plain otherwise (GEMM2 weighted it), so that path keeps its bits.
  auto add_row = [&](float& acc, int j, float f) {
    if (kSortedRows) {
      acc = fmaf(ywt[j], f, acc);
    } else {
      acc += f;
    }
  };
  const int col0 = blockIdx.y * kCombineCols;
  // Eight columns per thread with 16-byte loads and stores where rows allow
  // them; the sum runs over slots in the same order either way, so both
  // paths give the same bits.
  if (k % 8 == 0 && aligned16(y) && aligned16(out) && (!bias2 || aligned16(bias2))) {
    const int c8 = col0 / 8 + threadIdx.x;
    if (c8 >= k / 8) return;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < top_k; j0 += 8) {
      uint4 v[8];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = j0 + jj;
        if (j < top_k && valid[j]) v[jj] = reinterpret_cast<const uint4*>(yrow[j])[c8];
      }
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = j0 + jj;
        if (!(j < top_k && valid[j])) continue;
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[jj]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(h[q]);
          add_row(acc[2 * q], j, f.x);
          add_row(acc[2 * q + 1], j, f.y);
        }
      }
    }
    if (bias2) {
      // bias_at's sum for the thread's eight columns, each slot's bias row
      // read as two 16-byte loads (rows are 16-byte aligned: k % 8 == 0 on
      // this path) instead of one float a column and slot.
      float b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < top_k; ++j) {
        if (!valid[j]) continue;
        const float wj = w[size_t(tok) * top_k + j];
        const float4* row = reinterpret_cast<const float4*>(bias2 + size_t(expert[j]) * k) + 2 * c8;
        const float4 lo = row[0], hi = row[1];
        const float bv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int q = 0; q < 8; ++q) b[q] += wj * bv[q];
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += b[q];
    }
    if (out_dtype == 1) {
      float4* o = reinterpret_cast<float4*>(static_cast<float*>(out) + size_t(tok) * k) + 2 * c8;
      o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      uint4 r;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
      for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(out) + size_t(tok) * k)[c8] = r;
    }
    return;
  }
  const int col_end = min(k, col0 + kCombineCols);
  for (int c = col0 + threadIdx.x; c < col_end; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) {
      if (valid[j]) add_row(acc, j, __bfloat162float(yrow[j][c]));
    }
    if (bias2) acc += bias_at(c);
    if (out_dtype == 1) {
      static_cast<float*>(out)[size_t(tok) * k + c] = acc;
    } else {
      static_cast<__nv_bfloat16*>(out)[size_t(tok) * k + c] = __float2bfloat16_rn(acc);
    }
  }
}

}  // namespace expertd
